"""The `opentinker` command. Each area registers its own sub-commands from its own module."""

from __future__ import annotations

import typer

app = typer.Typer(
    help="OpenTinker: train, track, federate and serve RL agents.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)

from opentinker.infra.stack_cli import app as _stack_app  # noqa: E402

app.add_typer(_stack_app, name="stack")

from opentinker.infra.cluster_cli import app as _cluster_app  # noqa: E402

app.add_typer(_cluster_app, name="cluster")

from opentinker.flows.cli import register as _register_pipeline  # noqa: E402

_register_pipeline(app)

from opentinker.flows.pool_cli import register as _register_pool  # noqa: E402

_register_pool(app)

from opentinker.serving.cli import register as _register_serving  # noqa: E402

_register_serving(app)

from opentinker.federated.cli import app as _federated_app  # noqa: E402

app.add_typer(_federated_app, name="federated")

from opentinker.llm.cli import app as _agent_app  # noqa: E402

app.add_typer(_agent_app, name="agent")
