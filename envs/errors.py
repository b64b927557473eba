"""Errors raised by the env SDK; each message names the env class or id and the field at fault."""

from __future__ import annotations


class EnvSpecError(ValueError):
    """An env is declared wrongly: unknown id, missing or invalid space, unsupported space type."""


class EnvValidationError(AssertionError):
    """``validate_env`` found problems; ``problems`` lists every one of them."""

    def __init__(self, env_name: str, problems: list[str]):
        self.env_name = env_name
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{env_name} failed validation with {len(self.problems)} problem(s):\n{lines}")


class EnvAPIWarning(UserWarning):
    """An env works but uses an old or defaulted API (gym's 4-tuple, no ``reset``) that OpenTinker converts."""


class WorkerOutOfMemoryError(MemoryError):
    """A rollout worker ran out of memory; the message says which knobs shrink what it holds."""
