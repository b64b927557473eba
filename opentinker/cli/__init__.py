"""The `opentinker` command. Each area registers its own sub-commands from its own module."""

from __future__ import annotations

import typer

app = typer.Typer(
    help="OpenTinker: train, track, federate and serve RL agents.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)

from opentinker.cli.stack import app as _stack_app  # noqa: E402

app.add_typer(_stack_app, name="stack")

from opentinker.cli.cluster import app as _cluster_app  # noqa: E402

app.add_typer(_cluster_app, name="cluster")

from opentinker.cli.train import register as _register_pipeline  # noqa: E402

_register_pipeline(app)

from opentinker.cli.deploy import register as _register_pool  # noqa: E402

_register_pool(app)

from opentinker.cli.serve import register as _register_serving  # noqa: E402

_register_serving(app)

from opentinker.cli.federated import app as _federated_app  # noqa: E402

app.add_typer(_federated_app, name="federated")

from opentinker.cli.agent import app as _agent_app  # noqa: E402

app.add_typer(_agent_app, name="agent")
