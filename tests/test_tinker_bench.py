"""bench/tinker_api.py's two halves at the smallest size, on the tiny model: the SDK loop through the test server and
the built-in GRPO in-process run one update each and report what the bench's JSON line is made of."""

from __future__ import annotations

import importlib.util
from argparse import Namespace
from pathlib import Path

import pytest
from fixtures.tinker import CACHE

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "tinker_api.py"


@pytest.fixture(scope="module")
def bench():
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(SCRIPT.parent))  # as when run as a script: it imports its sibling grpo_common.py
        spec = importlib.util.spec_from_file_location("tinker_api_bench", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module


ARGS = Namespace(
    base="tiny",
    steps=1,
    group_size=2,
    prompts_per_step=2,
    max_new_tokens=4,
    temperature=1.0,
    lr=1e-3,
    eval_prompts=2,
    seed=0,
    builtin_backend="local",
    workers=1,
    latency_iters=2,
    cache_dir=CACHE,
)


def test_both_halves_of_the_bench_run_and_report(bench, tinker_server):
    sdk = bench.sdk_run(ARGS, tinker_server.url, tinker_server.key("bench"))
    builtin = bench.builtin_run(ARGS)
    for half in (sdk, builtin):
        assert half["completions_per_s"] > 0 and len(half["curve"]) == 1
        assert 0 <= half["heldout_before"] <= 1 and 0 <= half["heldout_after"] <= 1
    latency = bench.latencies(ARGS, tinker_server.url, tinker_server.key("bench"))
    assert set(latency) == {"forward_backward", "optim_step", "sample"} and latency["sample"]["n"] == 2
    assert bench.within_noise(0.25, 0.3125, 32) and not bench.within_noise(0.1, 0.6, 32)
