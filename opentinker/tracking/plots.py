"""Learning-curve and dashboard-metric PNGs from the per-iteration history (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

RETURN_KEYS = ("charts/episodic_return_mean", "charts/episodic_return")
"""Metric names tried, in order, for the mean episodic return."""


def _series(history: list[dict[str, float]], key: str) -> tuple[list[float], list[float]]:
    points = [(row["step"], row[key]) for row in history if key in row]
    return [p[0] for p in points], [p[1] for p in points]


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only: no display on a server)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def learning_curve(history: list[dict[str, float]], path: Path, eval_mean: float | None = None) -> Path:
    """Mean episodic return against the global env step, with the min–max band when logged."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    key = next((k for k in RETURN_KEYS if any(k in row for row in history)), None)
    if key is not None:
        steps, mean = _series(history, key)
        ax.plot(steps, mean, label="episodic return (mean)", color="tab:blue")
        low_steps, low = _series(history, "charts/episodic_return_min")
        _, high = _series(history, "charts/episodic_return_max")
        if low and len(low) == len(high):
            ax.fill_between(low_steps, low, high, alpha=0.2, color="tab:blue", label="min–max")
    if eval_mean is not None:
        ax.axhline(eval_mean, color="tab:green", linestyle="--", label=f"evaluation mean {eval_mean:.1f}")
    ax.set_xlabel("global env step")
    ax.set_ylabel("return")
    ax.set_title("Learning curve")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, plt, path)


def perf_metrics(history: list[dict[str, float]], path: Path) -> Path:
    """One panel per ``perf/*`` metric: the article's dashboard (rollout efficiency, gradient delay, policy lag,
    bytes on the wire, CPU/GPU utilisation)."""
    plt = pyplot()
    keys = sorted({k for row in history for k in row if k.startswith("perf/")}) or ["perf/cpu_percent"]
    cols = 3
    rows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        steps, values = _series(history, key)
        ax.plot(steps, values, color="tab:orange")
        ax.set_title(key.removeprefix("perf/"), fontsize=9, y=1.0)  # a fixed title place: no per-panel layout pass
        ax.tick_params(labelsize=7)
        ax.locator_params(nbins=4)  # each tick is an object matplotlib builds and lays out: most of the figure's time
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    fig.suptitle("Dashboard metrics (perf/) against global env step")
    height = 2.8 * rows  # fixed margins in inches: tight_layout measures every tick label, seconds for a dozen panels
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.45 / height, top=1 - 0.6 / height, hspace=0.45, wspace=0.25)
    return _save(fig, plt, path, tight=False)


def evaluation_returns(returns: list[float], seed: int | None, path: Path) -> Path:
    """The evaluation episode by episode (one bar per seed) with its mean and ±1 std band: the spread and the
    outliers that the two summary metrics, logged once at the final step, cannot chart."""
    import numpy as np

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    first = seed or 0
    seeds = [str(first + i) for i in range(len(returns))]
    mean, std = float(np.mean(returns)), float(np.std(returns))
    ax.bar(seeds, returns, color="tab:green", alpha=0.7, label="episode return")
    ax.axhline(mean, color="black", linestyle="--", label=f"mean {mean:.1f}")
    ax.axhspan(mean - std, mean + std, color="grey", alpha=0.2, label=f"± std {std:.1f}")
    ax.set_xlabel("evaluation episode (env seed)")
    ax.set_ylabel("return")
    ax.set_title(f"Evaluation: {len(returns)} episodes")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="lower right")
    return _save(fig, plt, path)


def _save(fig, plt, path: Path, tight: bool = True) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
