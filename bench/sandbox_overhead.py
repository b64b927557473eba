"""Start-up cost of the bubblewrap sandbox for one ``print(17*23)`` call (issue 13).

Three ways to run the same code, interleaved call by call so machine load hits them alike:
- ``bare``: ``python -I -S -c`` in a plain subprocess (the reference: an interpreter start and nothing else);
- ``guard``: ``run_python`` with ``OPENTINKER_SANDBOX=none`` (the previous launcher: audit guard + rlimits in a
  subprocess, minus its ``unshare --net``);
- ``bwrap``: ``run_python`` as shipped (namespaces, read-only binds, tmpfs, seccomp, pids cgroup when root).
Final line: {"bwrap_median_s", "guard_median_s", "bare_median_s", "bwrap_overhead_s" (bwrap - bare), ...}

    .venv/bin/python bench/sandbox_overhead.py [--calls 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from rich.progress import Progress

CODE = "print(17*23)"


def bare() -> str:
    return subprocess.run(
        [os.path.realpath(sys.executable), "-I", "-S", "-c", CODE], capture_output=True, text=True, check=True
    ).stdout


def sandboxed(mode: str) -> str:
    from opentinker.infra.settings import get_settings
    from opentinker.llm import run_python

    os.environ["OPENTINKER_SANDBOX"] = mode
    get_settings.cache_clear()
    result = run_python(CODE)
    assert result.ok, result.report()
    return result.output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    import opentinker.llm  # noqa: F401  (its import time is not the sandbox's)

    runs = {"bare": bare, "guard": lambda: sandboxed("none"), "bwrap": lambda: sandboxed("bwrap")}
    start = time.perf_counter()
    sandboxed("bwrap")  # one-time costs per process: bwrap probe, seccomp program, bind list, cgroup lookup
    first_s = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in runs}
    with Progress() as progress:
        task = progress.add_task("print(17*23), interleaved", total=args.calls)
        for _ in range(args.calls):
            for name, run in runs.items():
                start = time.perf_counter()
                assert run().strip() == "391"
                times[name].append(time.perf_counter() - start)
            progress.advance(task)
    median = {name: statistics.median(t) for name, t in times.items()}
    p90 = {name: statistics.quantiles(t, n=10)[-1] for name, t in times.items()}
    print(
        json.dumps(
            {
                "bwrap_median_s": round(median["bwrap"], 4),
                "guard_median_s": round(median["guard"], 4),
                "bare_median_s": round(median["bare"], 4),
                "bwrap_overhead_s": round(median["bwrap"] - median["bare"], 4),
                "bwrap_vs_guard": round(median["bwrap"] / median["guard"], 2),
                "bwrap_p90_s": round(p90["bwrap"], 4),
                "first_call_s": round(first_s, 4),
                "calls": args.calls,
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "command": f"python bench/sandbox_overhead.py --calls {args.calls}",
            }
        )
    )


if __name__ == "__main__":
    main()
