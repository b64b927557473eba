"""Request validation derived from a gymnasium observation space: shape, dtype, finiteness, bounds.

Errors are ``PydanticCustomError`` so that, raised inside a pydantic validator, BentoML answers 400
with the field (``loc``) and a message saying what was expected and where it failed.
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

    @classmethod
    def from_space(cls, space) -> ObservationSchema:
        from gymnasium import spaces

        if isinstance(space, spaces.Box):
            low, high = space.low.astype(np.float64), space.high.astype(np.float64)
            return cls(tuple(space.shape), np.dtype(space.dtype), low, high)
        if isinstance(space, spaces.Discrete):
            start = int(space.start)
            return cls(
                (), np.dtype(np.int64), np.array(start, np.float64), np.array(start + int(space.n) - 1, np.float64)
            )
        if isinstance(space, spaces.MultiDiscrete):
            start = np.asarray(space.start, np.float64)
            return cls(tuple(space.shape), np.dtype(np.int64), start, start + space.nvec - 1)
        if isinstance(space, spaces.MultiBinary):
            shape = tuple(space.shape)
            return cls(shape, np.dtype(np.int8), np.zeros(shape), np.ones(shape))
        raise ValueError(
            f"observation_space: expected Box, Discrete, MultiDiscrete or MultiBinary, got {type(space).__name__}"
        )

    @property
    def is_integer(self) -> bool:
        return self.dtype.kind in "iu"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ObservationSchema)
            and (self.shape, self.dtype) == (other.shape, other.dtype)
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
        return str(self.dtype.type(x))

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
            return _element_error(arr, ~np.isfinite(arr), "expected a finite number")
        if self.is_integer and not np.array_equal(arr, np.round(arr)):
            return _element_error(arr, arr != np.round(arr), f"expected an integer ({self.dtype.name})")
        low, high = np.broadcast_to(self.low, arr.shape), np.broadcast_to(self.high, arr.shape)
        first = tuple(int(i) for i in np.argwhere((arr < low) | (arr > high))[0])
        return PydanticCustomError(
            "obs_bounds",
            "obs{index} = {value}: expected a value within [{low}, {high}]",
            {
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


def _element_error(arr: np.ndarray, mask: np.ndarray, message: str) -> PydanticCustomError:
    first = tuple(int(i) for i in np.argwhere(mask)[0])
    return PydanticCustomError(
        "obs_value", "obs{index} = {value}: " + message, {"index": _index(first), "value": str(arr[first].item())}
    )


def _index(position: tuple[int, ...]) -> str:
    return "".join(f"[{i}]" for i in position)
