"""Request validation derived from a gymnasium observation space: shape, dtype, finiteness, bounds.

Errors are ``PydanticCustomError`` so that, raised inside a pydantic validator, BentoML answers 400
with the field (``loc``) and a message saying what was expected and where it failed. A Dict observation is a JSON
object with one entry per key, a Tuple observation a JSON array of its parts; each part is checked by its own
``ObservationSchema``, and errors name the part (``obs['image'][3][0][1] = 300: ...``). Images are nested lists of
integers in [0, 255].
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
from pydantic_core import PydanticCustomError


@dataclass(frozen=True, eq=False)
class ObservationSchema:
    """What one observation must look like; built from the policy's observation space."""

    shape: tuple[int, ...]
    dtype: np.dtype
    low: np.ndarray
    high: np.ndarray
    name: str = "obs"
    """How errors name the observation (a Dict part: ``obs['image']``)."""

    @classmethod
    def from_space(cls, space, name: str = "obs") -> ObservationSchema:
        """The schema of a plain (not Dict/Tuple) space; ``observation_schema`` takes any."""
        from gymnasium import spaces

        if isinstance(space, spaces.Box):
            low, high = space.low.astype(np.float64), space.high.astype(np.float64)
            return cls(tuple(space.shape), np.dtype(space.dtype), low, high, name)
        if isinstance(space, spaces.Discrete):
            start = int(space.start)
            bounds = np.array(start, np.float64), np.array(start + int(space.n) - 1, np.float64)
            return cls((), np.dtype(np.int64), *bounds, name)
        if isinstance(space, spaces.MultiDiscrete):
            start = np.asarray(space.start, np.float64)
            return cls(tuple(space.shape), np.dtype(np.int64), start, start + space.nvec - 1, name)
        if isinstance(space, spaces.MultiBinary):
            shape = tuple(space.shape)
            return cls(shape, np.dtype(np.int8), np.zeros(shape), np.ones(shape), name)
        raise ValueError(
            f"observation_space: expected Box, Discrete, MultiDiscrete, MultiBinary or a Dict/Tuple of them, "
            f"got {type(space).__name__}"
        )

    @property
    def min_json_bytes(self) -> int:
        """The fewest bytes one observation can take as JSON (a digit and a separator per number)."""
        return 2 * int(np.prod(self.shape, dtype=np.int64))

    @property
    def is_integer(self) -> bool:
        return self.dtype.kind in "iu"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ObservationSchema)
            and (self.shape, self.dtype, self.name) == (other.shape, other.dtype, other.name)
            and np.array_equal(self.low, other.low)
            and np.array_equal(self.high, other.high)
        )

    __hash__ = None  # mutable arrays inside: not hashable

    def describe(self) -> dict[str, Any]:
        """JSON-safe summary for /metadata (infinite bounds become null)."""
        return {
            "shape": list(self.shape),
            "dtype": self.dtype.name,
            "low": _json_bound(self.low),
            "high": _json_bound(self.high),
        }

    def _fmt(self, x: float) -> str:
        """In the space's dtype, except integers outside it (uint8 would print 300 as 44)."""
        return str(int(x)) if self.is_integer and float(x).is_integer() else str(self.dtype.type(x))

    @cached_property
    def _finite_bounds(self) -> bool:
        return bool(np.isfinite(self.low).all() and np.isfinite(self.high).all())

    def validate(self, value: Any, *, batched: bool = False, max_rows: int | None = None) -> np.ndarray:
        """Return ``value`` as an array of this space's dtype, or raise naming the first problem.

        A few vectorised checks accept valid input (the hot path); only a rejected value is
        examined element by element to say exactly what is wrong.
        """
        try:
            arr = np.asarray(value)
        except ValueError:
            arr = None
        if arr is not None and arr.dtype.kind in "iuf" and self._acceptable(arr, batched, max_rows):
            return arr.astype(self.dtype, copy=False)
        raise self._diagnose(value, batched, max_rows)

    def _acceptable(self, arr: np.ndarray, batched: bool, max_rows: int | None) -> bool:
        if batched:
            if arr.shape[1:] != self.shape or arr.ndim != len(self.shape) + 1 or arr.shape[0] == 0:
                return False
            if max_rows is not None and arr.shape[0] > max_rows:
                return False
        elif arr.shape != self.shape:
            return False
        with np.errstate(invalid="ignore"):
            if not ((arr >= self.low) & (arr <= self.high)).all():  # NaN fails both comparisons
                return False
        if not self._finite_bounds and not np.isfinite(arr).all():
            return False
        return not self.is_integer or bool((arr == np.floor(arr)).all())

    def _diagnose(self, value: Any, batched: bool, max_rows: int | None) -> PydanticCustomError:
        """The first problem with a rejected value, in the order a client should fix them."""
        expected = ("(N, " + ", ".join(map(str, self.shape)) + ")") if batched else str(self.shape)
        expected = expected.replace(", )", ")")
        try:
            arr = _as_numeric_array(value, self.dtype, expected)
        except PydanticCustomError as exc:
            return exc
        want = (arr.shape[0], *self.shape) if batched and arr.ndim >= 1 else self.shape
        if arr.shape != want or (batched and arr.ndim == 0):
            return PydanticCustomError(
                "obs_shape", "expected shape {expected}, got {got}", {"expected": expected, "got": str(arr.shape)}
            )
        if batched and arr.shape[0] == 0:
            return PydanticCustomError("obs_shape", "expected at least one observation, got an empty batch")
        if batched and max_rows is not None and arr.shape[0] > max_rows:
            return PydanticCustomError(
                "obs_batch_size",
                "expected at most {max} observations per request, got {got}",
                {"max": max_rows, "got": arr.shape[0]},
            )
        if not np.all(np.isfinite(arr)):
            return _element_error(self.name, arr, ~np.isfinite(arr), "expected a finite number")
        if self.is_integer and not np.array_equal(arr, np.round(arr)):
            return _element_error(self.name, arr, arr != np.round(arr), f"expected an integer ({self.dtype.name})")
        low, high = np.broadcast_to(self.low, arr.shape), np.broadcast_to(self.high, arr.shape)
        first = tuple(int(i) for i in np.argwhere((arr < low) | (arr > high))[0])
        return PydanticCustomError(
            "obs_bounds",
            "{name}{index} = {value}: expected a value within [{low}, {high}]",
            {
                "name": self.name,
                "index": _index(first),
                "value": self._fmt(arr[first]),
                "low": self._fmt(low[first]),
                "high": self._fmt(high[first]),
            },
        )


def _as_numeric_array(value: Any, dtype: np.dtype, expected: str) -> np.ndarray:
    if isinstance(value, (str, bytes, dict)) or value is None:
        raise PydanticCustomError(
            "obs_type",
            "expected numbers ({dtype}) shaped {expected}, got {got}",
            {"dtype": dtype.name, "expected": expected, "got": type(value).__name__},
        )
    try:
        arr = np.asarray(value)
    except ValueError:
        raise PydanticCustomError(
            "obs_shape",
            "expected a rectangular array shaped {expected}, got ragged nested lists",
            {"expected": expected},
        ) from None
    if arr.dtype.kind not in "iuf":
        raise PydanticCustomError(
            "obs_type",
            "expected numbers ({dtype}) shaped {expected}, got non-numeric values ({got})",
            {"dtype": dtype.name, "expected": expected, "got": _non_numeric(value)},
        )
    return arr.astype(np.float64)


def _json_bound(bound: np.ndarray) -> Any:
    out = bound.astype(object)
    out[~np.isfinite(bound)] = None
    return out.tolist()


def _non_numeric(value: Any) -> str:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif not isinstance(item, (int, float)) or isinstance(item, bool):
            return type(item).__name__
    return "mixed"


def _element_error(name: str, arr: np.ndarray, mask: np.ndarray, message: str) -> PydanticCustomError:
    first = tuple(int(i) for i in np.argwhere(mask)[0])
    return PydanticCustomError(
        "obs_value",
        "{name}{index} = {value}: " + message,
        {"name": name, "index": _index(first), "value": str(arr[first].item())},
    )


def _index(position: tuple[int, ...]) -> str:
    return "".join(f"[{i}]" for i in position)


def observation_schema(space) -> ObservationSchema | StructSchema:
    """What a request's observation must look like for ``space``: a ``StructSchema`` for Dict/Tuple spaces."""
    from gymnasium import spaces

    if isinstance(space, (spaces.Dict, spaces.Tuple)):
        return StructSchema.from_space(space)
    return ObservationSchema.from_space(space)


@dataclass(frozen=True, eq=False)
class StructSchema:
    """A Dict (JSON object) or Tuple (JSON array) observation: one ``ObservationSchema`` per part, in space order.

    ``validate`` returns one observation as a dict / tuple of arrays; batched, a list of them (BentoML's adaptive
    batching joins lists across requests; the policy stacks them).
    """

    container: str
    """"dict" or "tuple"."""
    keys: tuple[Any, ...]
    parts: tuple[ObservationSchema, ...]

    @classmethod
    def from_space(cls, space) -> StructSchema:
        from gymnasium import spaces

        is_dict = isinstance(space, spaces.Dict)
        items = list(space.spaces.items()) if is_dict else list(enumerate(space.spaces))
        parts = []
        for key, sub in items:
            if isinstance(sub, (spaces.Dict, spaces.Tuple)):
                raise ValueError(f"observation_space[{key!r}]: nested Dict/Tuple observations are not supported")
            parts.append(ObservationSchema.from_space(sub, name=f"obs[{key!r}]"))
        return cls("dict" if is_dict else "tuple", tuple(key for key, _ in items), tuple(parts))

    @property
    def min_json_bytes(self) -> int:
        return sum(part.min_json_bytes for part in self.parts)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructSchema) and (self.container, self.keys, self.parts) == (
            other.container,
            other.keys,
            other.parts,
        )

    __hash__ = None

    def describe(self) -> dict[str, Any]:
        described = [part.describe() for part in self.parts]
        if self.container == "dict":
            return {"type": "Dict", "spaces": dict(zip(self.keys, described))}
        return {"type": "Tuple", "spaces": described}

    def validate(self, value: Any, *, batched: bool = False, max_rows: int | None = None) -> Any:
        if not batched:
            return self._one(value, "obs")
        if not isinstance(value, list) or not value:
            raise PydanticCustomError(
                "obs_type",
                "expected a non-empty list of observations, each a JSON {what}, got {got}",
                {"what": self._what(), "got": type(value).__name__ if value != [] else "an empty list"},
            )
        if max_rows is not None and len(value) > max_rows:
            raise PydanticCustomError(
                "obs_batch_size",
                "expected at most {max} observations per request, got {got}",
                {"max": max_rows, "got": len(value)},
            )
        return [self._one(item, f"obs[{i}]") for i, item in enumerate(value)]

    def _what(self) -> str:
        if self.container == "dict":
            return f"object with keys {list(self.keys)}"
        return f"array of {len(self.parts)} parts"

    def _one(self, value: Any, where: str) -> Any:
        if self.container == "dict":
            if not isinstance(value, dict) or set(value) != set(self.keys):
                got = sorted(value) if isinstance(value, dict) else type(value).__name__
                raise PydanticCustomError(
                    "obs_type",
                    "{where}: expected a JSON {what}, got {got}",
                    {"where": where, "what": self._what(), "got": str(got)},
                )
            leaves = [value[key] for key in self.keys]
        else:
            if not isinstance(value, (list, tuple)) or len(value) != len(self.parts):
                raise PydanticCustomError(
                    "obs_type",
                    "{where}: expected a JSON {what}, got {got}",
                    {"where": where, "what": self._what(), "got": type(value).__name__},
                )
            leaves = list(value)
        checked = []
        for key, part, leaf in zip(self.keys, self.parts, leaves):
            try:
                checked.append(part.validate(leaf))
            except PydanticCustomError as exc:
                detail = exc.message()
                if not detail.startswith(part.name):  # shape/type errors: say which part
                    detail = f"obs[{key!r}]: {detail}"
                if where != "obs":  # one observation of a batch: say which
                    detail = f"{where}: {detail}"
                raise PydanticCustomError(exc.type, "{detail}", {"detail": detail}) from None
        return dict(zip(self.keys, checked)) if self.container == "dict" else tuple(checked)


def check_request_limit(schema: ObservationSchema | StructSchema, max_body_bytes: int) -> None:
    """Refuse a policy whose single observation cannot fit in a request body (the limit would answer every /act
    with 413)."""
    if schema.min_json_bytes > max_body_bytes:
        raise ValueError(
            f"observation_space: one observation takes at least {schema.min_json_bytes} bytes of JSON, over the "
            f"request body limit max_body_bytes={max_body_bytes}; raise OPENTINKER_SERVE_MAX_BODY_BYTES"
        )
