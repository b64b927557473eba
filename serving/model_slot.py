"""The policy a server process is serving, and the watcher that swaps in a new version when its alias moves.

A swap replaces one immutable ``ServedModel`` reference: requests already running keep the object they
started with, new requests see the new one, so a reload drops nothing. A version whose spaces differ
from the served one is refused (the API contract clients rely on must not change under them).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .observation import ObservationSchema, StructSchema, observation_schema

logger = logging.getLogger("opentinker.serving")
BUNDLED_PREFIX = "bentoml:"
"""Model URIs of policies bundled in a Bento's model store (``package.package_policy``)."""


@dataclass(frozen=True)
class ServedModel:
    """One loaded policy version and its request schema."""

    ref: Any
    """``tracking.registry.ModelRef``: name, exact version, run id, the URI as configured."""
    policy: Any
    """The RL core's numpy ``InferencePolicy`` (``act``, ``act_with_info``, spaces, ``spec``)."""
    schema: ObservationSchema | StructSchema
    loaded_at: float = field(default_factory=time.time)

    @property
    def version(self) -> str:
        return self.ref.version


def resolve(model_uri: str):
    """The exact version ``model_uri`` names now: registry/run/local URIs, or a policy bundled in a Bento."""
    from opentinker.tracking.registry import resolve_policy

    return bundled_ref(model_uri) if model_uri.startswith(BUNDLED_PREFIX) else resolve_policy(model_uri)


def bundled_ref(model_uri: str):
    """``bentoml:TAG`` -> a ``ModelRef`` for a policy saved in the BentoML model store by ``package_policy``."""
    import bentoml

    from opentinker.tracking.registry import ModelRef

    model = bentoml.models.get(model_uri[len(BUNDLED_PREFIX) :])
    meta = model.info.metadata
    return ModelRef(
        uri=model_uri,
        name=meta.get("name", model.tag.name),
        version=meta.get("version", model.tag.version),
        run_id=meta.get("run_id"),
        download_uri=str(model.path),
    )


def load_served_model(model_uri: str) -> ServedModel:
    """Resolve (pinning an alias to a version), download and load, then derive the request schema."""
    from opentinker.agents.export import load_policy
    from opentinker.tracking.registry import download_policy

    ref = resolve(model_uri)
    policy = load_policy(download_policy(ref))
    return ServedModel(ref, policy, observation_schema(policy.observation_space))


class ModelSlot:
    """Holds the current ``ServedModel`` of this process (one per server worker)."""

    def __init__(self) -> None:
        self.current: ServedModel | None = None
        self.last_error: str | None = None

    def require(self) -> ServedModel:
        if self.current is None:
            raise RuntimeError("no policy loaded yet")
        return self.current

    def version(self) -> str:
        return self.current.version if self.current is not None else "none"


class AliasWatcher:
    """Re-resolves the configured URI every ``interval_s`` (and on demand) and swaps in new versions."""

    def __init__(self, slot: ModelSlot, model_uri: str, interval_s: float):
        self.slot, self.model_uri, self.interval_s = slot, model_uri, interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._refused: str | None = None

    def check_now(self, force: bool = False) -> dict[str, Any]:
        """Swap when the URI now names another version; returns what happened (never raises).

        A refused version is not retried by the poll until the URI moves on (``force`` retries it).
        """
        with self._lock:
            previous = self.slot.version()
            unchanged = {"changed": False, "previous": previous, "current": previous, "error": None}
            ref = None
            try:
                ref = resolve(self.model_uri)
                if ref.version == previous:
                    self._refused = self.slot.last_error = None
                    return unchanged
                if ref.version == self._refused and not force:
                    return {**unchanged, "error": self.slot.last_error}
                candidate = load_served_model(self.model_uri)
                self._check_compatible(candidate)
            except Exception as exc:  # keep serving the old version; report why the new one was refused
                self._refused = ref.version if ref is not None else None
                self.slot.last_error = f"{type(exc).__name__}: {exc}"
                logger.error("reload of %s refused: %s", self.model_uri, self.slot.last_error)
                return {**unchanged, "error": self.slot.last_error}
            self.slot.current, self.slot.last_error, self._refused = candidate, None, None
            logger.info("now serving %s version %s (was %s)", candidate.ref.name, candidate.version, previous)
            return {"changed": True, "previous": previous, "current": candidate.version, "error": None}

    def _check_compatible(self, candidate: ServedModel) -> None:
        current = self.slot.current
        if current is None:
            return
        if candidate.schema != current.schema:
            raise ValueError(f"observation space changed: {current.schema.describe()} -> {candidate.schema.describe()}")
        if candidate.policy.action_space != current.policy.action_space:
            raise ValueError(f"action space changed: {current.policy.action_space} -> {candidate.policy.action_space}")

    def start(self) -> None:
        if self.interval_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="opentinker-alias-watcher", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check_now()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
