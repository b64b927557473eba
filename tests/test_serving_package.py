"""``opentinker package``: an offline ``bentoml build`` of the policy service with the policy bundled."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml
from fixtures.serving import make_policy_export

pytestmark = pytest.mark.slow  # starts real services or trains through a flow


def test_package_builds_a_bento_that_serves_the_bundled_policy(tmp_path):
    export = make_policy_export(tmp_path / "export", seed=11)
    # Offline: any attempt to reach the network goes to a dead proxy.
    env = {
        **os.environ,
        "BENTOML_HOME": str(tmp_path / "bentoml"),
        "BENTOML_DO_NOT_TRACK": "True",
        "HTTP_PROXY": "http://127.0.0.1:9",
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "PIP_NO_INDEX": "1",
    }
    cli = os.path.join(os.path.dirname(sys.executable), "opentinker")
    done = subprocess.run([cli, "package", str(export)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    tag = done.stdout.split("built ", 1)[1].split()[0]
    name, version = tag.split(":")
    bento_dir = tmp_path / "bentoml" / "bentos" / name / version
    bento = yaml.safe_load((bento_dir / "bento.yaml").read_text())
    assert bento["service"] == "opentinker.serving.policy_service:PolicyService"
    served_uri = {e["name"]: e["value"] for e in bento["envs"]}["OPENTINKER_SERVE_MODEL"]
    assert served_uri.startswith("bentoml:") and bento["models"][0]["tag"] == served_uri[len("bentoml:") :]
    assert list((bento_dir / "env" / "python" / "wheels").glob("opentinker-*.whl")), "project code ships as a wheel"
    assert "act_batch" in (bento_dir / "apis" / "openapi.yaml").read_text()

    obs = np.random.default_rng(1).uniform(-0.2, 0.2, size=(16, 4)).astype(np.float32)
    probe = (
        "import json, sys, numpy as np\n"
        "from opentinker.serving.model_slot import load_served_model\n"
        f"served = load_served_model({served_uri!r})\n"
        "obs = np.asarray(json.loads(sys.stdin.read()), np.float32)\n"
        "print(json.dumps({'version': served.version, 'actions': served.policy.act(obs).tolist()}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        input=json.dumps(obs.tolist()),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.getcwd(),
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    from opentinker.agents.export import load_policy

    np.testing.assert_array_equal(result["actions"], load_policy(export).act(obs))
    assert result["version"].startswith("local-")
