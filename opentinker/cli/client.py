"""``opentinker login|submit|jobs``: train on an OpenTinker server from a laptop (docs/service.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from opentinker.cli.console import cli_errors, console
from opentinker.cli.train import Algo

app = typer.Typer()
jobs_app = typer.Typer(help="Your jobs on the server: list, status, logs, cancel, resume, result, serve.")

JobId = Annotated[str, typer.Argument(help="The job's id (job-...).")]


def _client():
    from opentinker.server.client import Client

    return Client()


@app.command()
@cli_errors
def login(
    url: Annotated[str, typer.Argument(help="The server, e.g. https://opentinker.example.com")],
    api_key: Annotated[
        str | None, typer.Option(help="Your key (tml-...); asked for when left out (not echoed).")
    ] = None,
) -> None:
    """Check the key against the server and store both for later commands (mode 0600)."""
    from opentinker.server.client import Client, save_credentials

    key = api_key or typer.prompt("API key", hide_input=True)
    me = Client(url, key).whoami()
    path = save_credentials(url.rstrip("/"), key)
    console.print(f"logged in to {url} as tenant {me['tenant']} (key {me['key_id']}); saved to {path}", highlight=False)


@app.command()
@cli_errors
def submit(
    env_id: Annotated[
        str,
        typer.Argument(
            help="Gymnasium id (CartPole-v1), your env as package.module:Class, or with --algo grpo a text task "
            "(arithmetic) or your TextEnv as package.module:factory."
        ),
    ],
    algo: Algo = None,
    steps: Annotated[int | None, typer.Option(help="Total env steps (grpo: optimiser updates).")] = None,
    config: Annotated[Path | None, typer.Option(help="TOML or JSON file of TrainParams fields.")] = None,
    priority: Annotated[int, typer.Option(help="0-10; higher starts sooner among your queued jobs.")] = 0,
    seed: Annotated[int | None, typer.Option(help="Random seed.")] = None,
    wheel: Annotated[Path | None, typer.Option(help="Upload this wheel instead of the env's package folder.")] = None,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Print the job id and return at once.")] = False,
) -> None:
    """Queue a training job on the server and follow it: queue position, then training, then its result."""
    from opentinker.server.client import spec_from
    from opentinker.server.watch import follow

    client = _client()
    job = client.submit(spec_from(env_id, config, algo, steps, seed), priority=priority, wheel=wheel)
    console.print(f"job {job['id']} queued on {client.url}", highlight=False)
    if detach:
        return
    final = follow(client, job, console)
    _print_outcome(client, final)


@app.command()
@cli_errors
def dashboard(
    open_browser: Annotated[bool, typer.Option("--open", help="Open the experiment's page in your browser.")] = False,
) -> None:
    """Your tenant's MLflow UI: its runs, learning curves, artifacts and registered models, as your tenant's own MLflow
    user (the server says which; other tenants' experiments answer "permission denied")."""
    info = _client().dashboard()
    console.print(
        f"MLflow UI of experiment {info['experiment']}: {info['experiment_url']}\n"
        f"registered models: {info['models_url']}\n"
        f"sign in as {info['username']} with password {info['password']}",
        highlight=False,
    )
    if open_browser:
        import webbrowser

        webbrowser.open(info["experiment_url"])


def _print_outcome(client, job: dict) -> None:
    if job["state"] != "SUCCEEDED":
        console.print(f"[bold red]{job['state']}[/]: {job['reason']}", highlight=False)
        raise typer.Exit(1)
    console.print("\n".join(outcome_lines(client.result(job["id"]))), highlight=False)


def outcome_lines(result: dict) -> list[str]:
    """A finished job's result as the CLI prints it: a policy, a GRPO adapter, or a group's model per agent kind."""
    if result.get("kinds"):
        models = [
            f"{kind}: {k['model_name']} version {k['model_version']} · mean return {k['eval_mean']:.1f} ± "
            f"{k['eval_std']:.1f}"
            for kind, k in result["kinds"].items()
        ]
        return [*models, f"Registered: {result['decision']}", f"MLflow run: {result['run_id']}"]
    if result.get("heldout_success") is not None:  # a GRPO job's adapter
        evaluation = f"Held-out success: {result['heldout_success']:.1%}"
    else:
        evaluation = f"Evaluation: mean return {result['eval_mean']:.1f} ± {result['eval_std']:.1f}"
        evaluation += f" ({result['eval_action']} actions, as served)" if result.get("eval_action") else ""
    return [
        f"Model: {result['model_name']} version {result['model_version']} · aliases {', '.join(result['aliases'])}",
        evaluation,
        f"Gate: {result['decision']}",
        f"MLflow run: {result['run_id']}",
    ]


@jobs_app.command("list")
@cli_errors
def jobs_list(
    state: Annotated[str | None, typer.Option(help="QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED.")] = None,
) -> None:
    """Your jobs, newest first."""
    from opentinker.server.watch import describe

    table = Table("id", "state", "env", "algo", "steps", "priority", "created", "detail")
    for job in _client().jobs(state):
        table.add_row(
            job["id"],
            job["state"],
            job["env_id"],
            job["algorithm"],
            str(job["steps"]),
            str(job["priority"]),
            job["created_at"][:19],
            describe(job),
        )
    console.print(table)


@jobs_app.command("status")
@cli_errors
def jobs_status(
    job_id: JobId, json_out: Annotated[bool, typer.Option("--json", help="The raw status.")] = False
) -> None:
    """State, queue position or training progress, and the Prefect flow run."""
    from opentinker.server.watch import describe

    job = _client().job(job_id)
    if json_out:
        console.print_json(json.dumps(job))
        return
    console.print(f"{job['id']}: {job['state']} · {describe(job)}", highlight=False)
    if job.get("flow_run_url"):
        console.print(f"Prefect flow run: {job['flow_run_url']}", highlight=False)


@jobs_app.command("logs")
@cli_errors
def jobs_logs(
    job_id: JobId,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")] = False,
) -> None:
    """The job's log (its flow and task runs)."""
    for line in _client().logs(job_id, follow=follow):
        console.print(f"{line['timestamp'][11:23]} {line['message']}", markup=False, highlight=False)


@jobs_app.command("cancel")
@cli_errors
def jobs_cancel(job_id: JobId) -> None:
    """Stop the job; its last checkpoint stays (resume continues from it)."""
    job = _client().cancel(job_id)
    console.print(f"{job['id']}: {job['state']} ({job['reason']})", highlight=False)


@jobs_app.command("resume")
@cli_errors
def jobs_resume(job_id: JobId, detach: Annotated[bool, typer.Option("--detach", "-d")] = False) -> None:
    """Queue a cancelled or failed job again, from its last checkpoint."""
    from opentinker.server.watch import follow

    client = _client()
    job = client.resume(job_id)
    console.print(f"{job['id']} queued again (attempt {job['attempts']})", highlight=False)
    if not detach:
        _print_outcome(client, follow(client, job, console))


@jobs_app.command("result")
@cli_errors
def jobs_result(job_id: JobId) -> None:
    """The finished job's MLflow run, registered model version, aliases and gate decision."""
    console.print_json(json.dumps(_client().result(job_id)))


@jobs_app.command("serve")
@cli_errors
def jobs_serve(
    job_id: JobId,
    api_key: Annotated[
        str | None,
        typer.Option(help="A key of your choosing for calling the service directly (only its hash is sent)."),
    ] = None,
) -> None:
    """Serve the finished job's model on the server, behind your tenant's keys (and ``--api-key``)."""
    from opentinker.serving.auth import hash_api_key

    client = _client()
    service = client.deploy(job_id, hash_api_key(api_key) if api_key else None)
    console.print(
        f"service {service['id']}: {service['model_name']} v{service['model_version']} at {service['url']}\n"
        f'  with your tenant key: POST {client.url}/v1/services/{service["id"]}/act {{"obs": [...]}}',
        highlight=False,
    )
