"""The one check behind every typed dataclass config (``PPOConfig``, ``DQNConfig``, ``GRPOConfig``, ``BCConfig``,
``PursuitConfig``): their ``__post_init__`` calls it, so a bad value fails at construction naming the field and what
was expected. Pipeline params are pydantic models and run these same checks by building the config."""

from __future__ import annotations

from collections.abc import Iterable


def check_field(name: str, ok: bool, expected: str, value: object) -> None:
    """``ValueError("<name> must be <expected>, got <value>")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def check_ints(config: object, names: Iterable[str], minimum: int = 1, prefix: str = "") -> None:
    """Each field of ``config`` in ``names`` is an int (not a bool) ``>= minimum``."""
    for name in names:
        value = getattr(config, name)
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
        check_field(f"{prefix}{name}", ok, f"an int >= {minimum}", value)
