"""The last quickstart step: serve a registered policy on loopback and ask it for one action over HTTP."""

from __future__ import annotations

import secrets

from rich.console import Console


def query_served_policy(model_ref: str, env_id: str, console: Console) -> list:
    """Deploy ``model_ref`` with BentoML on 127.0.0.1, send one observation, print the action, stop the server."""
    from opentinker.envs import make_env
    from opentinker.serving.deploy import deploy

    env = make_env(env_id)
    observation, _ = env.reset(seed=0)
    env.close()
    shown = [round(float(x), 3) for x in observation]
    api_key = secrets.token_urlsafe(24)
    with console.status(f"Starting a BentoML server for {model_ref} on loopback…"):
        deployment = deploy(model_ref, api_key=api_key, host="127.0.0.1")
    try:
        action = deployment.predict(observation.tolist())
        console.print(f"Served at {deployment.url}: observation {shown} → action {action}")
        console.print(
            f"  the same request by hand: curl -X POST {deployment.url}/act -H 'Authorization: Bearer <api-key>' "
            f"-H 'Content-Type: application/json' -d '{{\"obs\": {shown}}}'"
        )
        return action
    finally:
        deployment.stop()
        console.print("Server stopped.")
