"""A markdown model card: what was trained, how, how well, from which code and packages."""

from __future__ import annotations

import datetime as dt
from typing import Any

from opentinker.tracking.runs import git_commit, package_versions


def render_model_card(
    params: dict[str, Any],
    evaluation: dict[str, Any] | None,
    model: dict[str, Any] | None,
    run_id: str,
    global_step: int,
) -> str:
    """Everything a reviewer needs to decide whether to serve this policy, in one page."""
    lines = [
        f"# Model card: {params.get('env_id')} · {params.get('algorithm', 'ppo').upper()}",
        "",
        f"- Created: {dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}",
        f"- Environment: `{params.get('env_id')}`",
        f"- Algorithm: {params.get('algorithm', 'ppo')} · policy MLP · seed {params.get('seed')}",
        f"- Training: {global_step:,} env steps (requested {params.get('steps'):,})",
        f"- MLflow run: `{run_id}`",
        f"- Git commit: `{git_commit()}`",
    ]
    if model:
        lines.append(
            f"- Registered model: `{model.get('name')}` version {model.get('version')}, aliases {model.get('aliases')}"
        )
        if model.get("decision"):
            lines.append(f"- Promotion decision: {model['decision']}")
    lines += ["", "## Evaluation", ""]
    if evaluation:
        lines += [
            f"Deterministic policy, {len(evaluation['returns'])} episodes, seeds from {evaluation['seed']}.",
            "",
            f"- Mean return: **{evaluation['mean']:.2f}** ± {evaluation['std']:.2f}",
            f"- Returns: {', '.join(f'{r:.0f}' for r in evaluation['returns'])}",
        ]
    else:
        lines.append("Not evaluated.")
    lines += ["", "## Configuration", "", "```"]
    lines += [f"{key} = {value!r}" for key, value in sorted(params.items())]
    lines += ["```", "", "## Package versions", ""]
    lines += [f"- {name} {version}" for name, version in package_versions().items()]
    return "\n".join(lines) + "\n"
