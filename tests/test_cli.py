"""The one CLI package: every group answers --help, and bad input to any group exits 1 with a message naming the
field (no traceback), while an unexpected error keeps its traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from opentinker.cli import app

runner = CliRunner()

GROUPS = ["stack", "cluster", "federated", "agent", "server", "tinker"]
COMMANDS = ["quickstart", "train", "evaluate", "release", "schedule", "publish", "serve", "package"]


def test_help_lists_every_command_and_group():
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for name in COMMANDS + GROUPS:
        assert f" {name} " in result.output, name


@pytest.mark.parametrize("args", [[name, "--help"] for name in COMMANDS + GROUPS])
def test_each_command_and_group_has_help(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 0 and f"{args[0]} [OPTIONS]" in result.output, result.output


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["train", "CartPole-v1", "--steps", "0"], "steps"),
        (["evaluate", "models:/x@champion", "--episodes", "0"], "episodes"),
        (["publish", "CartPole-v1", "--pool", "p", "--steps", "0"], "steps"),
        (["deploy", "CartPole-v1", "--pool", "p", "--steps", "0"], "steps"),  # publish's earlier name still works
        (["quickstart", "--steps", "0"], "steps"),
        (["serve", "models:/x@champion", "--api-key", "short"], "api_key"),
        (["package", "/no/such/export"], "model_uri"),
        (["agent", "serve", "--api-key", "long-enough-key-123", "--memory-window", "0"], "memory_window"),
        (["agent", "chat", "hi", "--llm", "scripted", "--tool", "nope"], "tools"),
        (["federated", "up", "--sites", "2", "--dataset", "5=x.npz"], "dataset"),
        (["federated", "run", "--strategy", "nope", "--simulate"], "strategy"),
        (["stack", "up", "--backend", "mysql"], "backend"),
        (["cluster", "up", "--nodes", "0"], "nodes"),
        (["tinker", "usage"], "TINKER_BASE_URL"),
    ],
    ids=lambda value: value if isinstance(value, str) else " ".join(value[:2]),
)
def test_bad_input_exits_1_naming_the_field(args, field):
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error:") and field in result.output, result.output
    assert "Traceback" not in result.output


def test_a_bad_setting_exits_1_naming_the_variable(monkeypatch):
    from opentinker.infra.settings import get_settings

    monkeypatch.setenv("OPENTINKER_RAY_NUM_CPUS", "many")
    get_settings.cache_clear()
    try:
        result = runner.invoke(app, ["stack", "status"])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 1 and result.output.startswith("error: invalid Settings"), result.output
    assert "ray_num_cpus" in result.output and "'many'" in result.output


def test_an_unexpected_error_keeps_its_traceback():
    """Not the project's bad input (the OS refuses the folder): the exception propagates, it is not summarised."""
    result = runner.invoke(app, ["federated", "certs", "--dir", "/proc/opentinker-certs", "--sites", "1"])
    assert result.exit_code == 1 and isinstance(result.exception, OSError), result.output
    assert "error:" not in result.output
