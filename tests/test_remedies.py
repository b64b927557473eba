"""The dashboard's remedies: one per figure whose median misses the article's target, none when all hold."""

from opentinker.tracking.remedies import GRADIENT_DELAY_TARGET_MS, ROLLOUT_EFFICIENCY_TARGET, dashboard_remedies


def rows(efficiency: float, worker_share: float, delay_ms: float, n: int = 5) -> list[dict[str, float]]:
    row = {
        "perf/rollout_efficiency": efficiency,
        "perf/rollout_worker_share": worker_share,
        "perf/gradient_delay_ms": delay_ms,
    }
    return [dict(row) for _ in range(n)]


def test_no_remedy_when_targets_hold():
    assert dashboard_remedies(rows(0.95, 0.99, 5.0)) == []
    assert dashboard_remedies([]) == []


def test_each_missed_target_names_its_remedy():
    inefficient = ROLLOUT_EFFICIENCY_TARGET - 0.3
    outside = dashboard_remedies(rows(inefficient, 0.5, 5.0))
    assert len(outside) == 1 and "outside the workers" in outside[0] and "backend='local'" in outside[0]
    inside = dashboard_remedies(rows(inefficient, 0.99, 5.0))
    assert len(inside) == 1 and "per-step bookkeeping" in inside[0]
    both = dashboard_remedies(rows(0.95, 0.99, GRADIENT_DELAY_TARGET_MS * 3))
    assert len(both) == 1 and both[0].startswith("gradient delay 150 ms")


def test_medians_ignore_one_slow_iteration():
    slow = rows(0.1, 0.1, 900.0, n=1)
    assert dashboard_remedies([*rows(0.95, 0.99, 5.0), *slow]) == []
    assert len(dashboard_remedies([*rows(0.95, 0.99, 5.0, n=1), *slow, *slow])) == 2
