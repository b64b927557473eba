"""Round overhead of federated training: Flower simulation vs the real deployment engine, same model and budget.

Reference measured in the same command: one site's local work of a round done in-process (train `local_steps`
env steps + evaluate), so `*_over_local` says how much a round costs beyond the learning itself.

    .venv/bin/python bench/federated_rounds.py --sites 3 --rounds 3 --local-steps 2048
    .venv/bin/python bench/federated_rounds.py --sites 3 --rounds 2 --local-steps 2048 --breakdown

Ends with one JSON line: {"round_s_median", "bytes_per_round", "sim_round_s", "deploy_round_s", ...}. With
``--breakdown`` the deployment runs with ``FLWR_LOG_LEVEL=DEBUG`` (timestamped Flower logs) and the line adds
``breakdown_s``: the median seconds of each phase of one message at a site, read from the SuperNode logs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from datetime import datetime
from itertools import pairwise
from pathlib import Path

from rich.progress import Progress


def _median_round(result) -> tuple[float, float]:
    rounds = [entry for entry in result.history if entry["round"] >= 1]
    seconds = statistics.median(entry["round/seconds"] for entry in rounds)
    payload = statistics.median(entry["round/bytes_sent"] + entry["round/bytes_received"] for entry in rounds)
    return seconds, payload


PHASES = (
    # (phase, the log line that ends it); each phase starts where the previous one ended
    ("node_idle_wait", "Receiving: "),  # after the previous reply: the server gathers, aggregates; the node sleeps 3 s
    ("node_pull", "Received successfully"),  # the SuperNode pulls the message from the SuperLink
    ("task_start", "Start FAB installation"),  # claim the task, start its process, pull message, context and FAB
    ("fab_install", "Start `ClientApp` Loading"),  # unzip + hash-check the FAB
    ("app_import", "ClientApp work started"),  # import the ClientApp module (once per process)
    ("app_work", "ClientApp work done"),  # train or evaluate: what a simulated round also does
    ("reply", "Sending: "),  # push the reply to the SuperNode, which looks for it every 0.5 s
    ("node_push", "Sent successfully"),  # the SuperNode pushes the reply to the SuperLink
)
_STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def breakdown(root: Path) -> dict[str, float]:
    """Median seconds per phase of a message at a site, from each site's ``supernode.log`` and the log of the
    process that ran its tasks (``executor.log``), merged by time: a SuperNode handles one message at a time, so
    that is one message after another. The first message has no idle wait."""
    spans: dict[str, list[float]] = {name: [] for name, _ in PHASES}
    for site in sorted(root.glob("site-*")):
        events = []
        for log in (site / "supernode.log", site / "executor.log"):
            for line in _ANSI.sub("", log.read_text(errors="replace")).splitlines() if log.exists() else []:
                stamp = _STAMP.search(line)
                phase = next((name for name, marker in PHASES if marker in line), None)
                if stamp is not None and phase is not None:
                    events.append((datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f"), phase))
        events.sort(key=lambda event: event[0])
        for (before, _), (now, phase) in pairwise(events):
            spans[phase].append((now - before).total_seconds())
    return {name: round(statistics.median(values), 3) for name, values in spans.items() if values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-steps", type=int, default=2048, help="env steps per site per round (fixed budget)")
    parser.add_argument("--skip-deploy", action="store_true", help="simulation only")
    parser.add_argument("--breakdown", action="store_true", help="time each phase of a deployed message (DEBUG logs)")
    args = parser.parse_args()

    from opentinker.federated import deploy, task
    from opentinker.federated.config import FedConfig
    from opentinker.federated.simulation import simulate

    config = dict(
        num_server_rounds=args.rounds,
        num_sites=args.sites,
        local_steps=args.local_steps,
        aggregation_interval=600.0,
        eval_episodes=3,
        min_completion_rate=1.0,
        register_as="",
        resume=False,
    )
    figures: dict[str, float] = {}
    with Progress() as progress:
        phases = progress.add_task("federated rounds bench", total=3)
        trainer = task.new_trainer("CartPole-v1", task.default_variant(0), seed=0)
        started = time.perf_counter()
        task.train_local(trainer, seconds=600.0, max_steps=args.local_steps)
        task.evaluate(trainer, episodes=3)
        figures["local_round_s"] = time.perf_counter() - started
        progress.advance(phases)

        sim = simulate(FedConfig(run_name=f"bench-sim-{int(time.time())}", **config))
        figures["sim_round_s"], sim_bytes = _median_round(sim)
        progress.advance(phases)

        figures["deploy_round_s"], deploy_bytes = float("nan"), float("nan")
        if not args.skip_deploy:
            root = Path(tempfile.mkdtemp(prefix="bench-federation-"))
            if args.breakdown:
                os.environ["FLWR_LOG_LEVEL"] = "DEBUG"
            fed = deploy.up(args.sites, root)
            try:
                result = deploy.submit(fed, FedConfig(run_name=f"bench-deploy-{int(time.time())}", **config))
                figures["deploy_round_s"], deploy_bytes = _median_round(result)
            finally:
                deploy.down(root)
            if args.breakdown:
                figures["breakdown_s"] = breakdown(root)
        progress.advance(phases)

    measured = [figures["deploy_round_s"], figures["sim_round_s"]]
    line = {
        "round_s_median": next(v for v in measured if v == v),
        "bytes_per_round": sim_bytes,
        "sim_round_s": round(figures["sim_round_s"], 3),
        "deploy_round_s": round(figures["deploy_round_s"], 3),
        "local_round_s": round(figures["local_round_s"], 3),
        "sim_over_local": round(figures["sim_round_s"] / figures["local_round_s"], 2),
        "deploy_over_sim": round(figures["deploy_round_s"] / figures["sim_round_s"], 2),
        "deploy_bytes_per_round": deploy_bytes,
        "sites": args.sites,
        "rounds": args.rounds,
        "local_steps": args.local_steps,
        **({"breakdown_s": figures["breakdown_s"]} if "breakdown_s" in figures else {}),
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
