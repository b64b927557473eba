"""The submit-time env check: ``validate_env`` and the preset lookup, run on the user's code inside a sandbox.

What ``opentinker train`` checks before it starts anything (``flows.validate``), run here in a throw-away sandbox with
no network and nothing writable but its ``/tmp``: importing an uploaded env runs the tenant's code, which must not
run in the server's process. The sandbox also resolves the spec (the preset for the env's kind of problem, its
reward threshold), so the job record holds the resolved spec and no trusted process imports the env to resolve it;
its answer is hostile data, validated as a ``RunSpec`` and merged into the job's spec by field (``merge_resolved``).
A result is remembered per (spec, upload), so a repeated job pays the sandbox's start (a fresh interpreter importing
gymnasium and the engine, a few seconds) once.

``python -m opentinker.server.env_check`` is the sandbox side: the spec as JSON on stdin, one JSON line out.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import threading
from pathlib import Path

from opentinker.infra.cgroups import job_cgroup, limits_for
from opentinker.infra.settings import Settings
from opentinker.tasks.spec import RunSpec

from . import tenants
from .db import Upload
from .sandbox import Sandbox

TIMEOUT_S = 120.0
MAX_ANSWER = 1 << 20
"""Bytes of the sandbox's answer read (a spec is a few kB)."""


class EnvCheck:
    """Runs the check in a sandbox (or, with ``sandbox = "none"``, a plain child process) and caches results."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._results: dict[tuple[str, str, str], str | None] = {}
        self._lock = threading.Lock()

    def check(self, spec: RunSpec, upload: Upload | None) -> tuple[str | None, RunSpec | None]:
        """Why the env cannot run (one line naming ``env_id``: it fails ``validate_env`` or has no preset), or None
        and the spec resolved in the sandbox (to be merged with ``merge_resolved``)."""
        key = (spec.model_copy(update={"run_name": None}).model_dump_json(), upload.sha256 if upload else "")
        with self._lock:
            if key not in self._results:
                self._results[key] = self._run(spec, upload)
            return self._results[key]

    def _run(self, spec: RunSpec, upload: Upload | None) -> tuple[str | None, RunSpec | None]:
        code_dir = tenants.uploads_dir(upload.tenant, self.settings) / upload.id if upload else None
        env = {"OPENTINKER_DATA_DIR": "/tmp/data", "MPLCONFIGDIR": "/tmp", "OPENTINKER_SANDBOX": "none"}
        if code_dir is not None:
            env["PYTHONPATH"] = str(code_dir)
        command = [sys.executable, "-m", "opentinker.server.env_check"]
        text = spec.model_dump_json()
        if self.settings.sandbox == "none":
            from .sandbox import base_env

            done = subprocess.run(
                command,
                input=text,
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
                env={**base_env(), **env, "OPENTINKER_DATA_DIR": str(Path("/tmp") / "opentinker-env-check")},
                check=False,
            )
        else:
            box = Sandbox(readonly=(code_dir,) if code_dir else (), env=env, network=False)
            cgroup = job_cgroup(f"env-check-{secrets.token_hex(6)}", limits_for(None, self.settings), self.settings)
            try:
                done = box.run(command, input=text, timeout=TIMEOUT_S, cgroup=cgroup)
                limit = cgroup.limit_hit() if cgroup is not None else None
            finally:
                if cgroup is not None:
                    cgroup.close()
            if limit:
                return f"env_id: {spec.env_id!r}: the env check hit its {limit.removesuffix(' exceeded')}", None
        lines = done.stdout.strip().splitlines()
        try:
            answer = json.loads(lines[-1][:MAX_ANSWER])
            if answer["error"] is not None:
                return str(answer["error"])[:500], None
            return None, RunSpec.model_validate(answer["spec"])
        except (IndexError, ValueError, KeyError, TypeError):
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
            return f"env_id: {spec.env_id!r} could not be checked: {tail[0][:300]}", None


def merge_resolved(spec: RunSpec, resolved: RunSpec) -> RunSpec:
    """``spec`` with what the sandbox resolved for it: the engine's table (same algorithm) and, when ``spec`` set
    none, the gate's threshold. Every other field stays the server's own (run name, experiment, model name, steps)."""
    if resolved.engine.algorithm != spec.engine.algorithm:
        raise ValueError(f"env check: resolved {resolved.engine.algorithm!r} for a {spec.engine.algorithm!r} job")
    threshold = spec.champion_threshold if spec.champion_threshold is not None else resolved.champion_threshold
    return spec.model_copy(update={"engine": resolved.engine, "champion_threshold": threshold, "resolved": True})


def main() -> None:
    """Sandbox side: check the spec on stdin as ``opentinker train`` does (``flows.validate``), resolving its preset;
    print ``{"error": null | "...", "spec": the resolved spec | null}``."""
    import warnings

    warnings.filterwarnings("ignore")
    from opentinker.agents.config import CONFIGS
    from opentinker.flows.params import ConfigError
    from opentinker.flows.validate import check_env_id, check_text_env, resolved
    from opentinker.tasks.spec import RunSpec

    spec = RunSpec.model_validate_json(sys.stdin.read())
    try:
        if spec.algorithm in CONFIGS:
            check_env_id(spec.env_id)
        elif spec.algorithm == "grpo" and ":" in spec.env_id:
            check_text_env(spec.env_id)
        spec = resolved(spec)
        error = None
    except ConfigError as exc:
        error = str(exc)
    except Exception as exc:  # the user's code may raise anything while it is imported or built
        error = f"env_id: {spec.env_id!r} failed to load: {type(exc).__name__}: {exc}"
    answer = {"error": error, "spec": None if error else spec.model_dump(mode="json")}
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
