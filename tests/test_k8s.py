"""infra/k8s manifests: strict schema validation (kubernetes-validate's offline schemas), a structural check of the
KubeRay RayCluster and RayJob (CRDs without an offline schema) with their pod templates validated as Pods, and
cross-references; then the server's manifests against the code they run: every `opentinker` command parsed by the real
CLI, every file it names mounted, every OPENTINKER_* a real setting, probes answered by the real app without a key, and
the per-job RayJob a cluster of its own that reaches nothing else."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from opentinker.infra.settings import Settings

K8S_DIR = Path(__file__).resolve().parents[1] / "infra" / "k8s"
K8S_VERSION = "1.32.0"
MANIFESTS = sorted(p for p in K8S_DIR.glob("*.yaml") if p.name != "kustomization.yaml")
TEMPLATES = sorted(K8S_DIR.glob("per-job/*.yaml"))
"""Applied once per job (placeholders JOB and TENANT), so not in kustomization.yaml."""

# The part of KubeRay's ray.io/v1 RayCluster CRD we rely on (the operator's full CRD is not available offline).
RAYCLUSTER_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "spec": {
            "type": "object",
            "required": ["headGroupSpec", "workerGroupSpecs"],
            "properties": {
                "rayVersion": {"type": "string"},
                "enableInTreeAutoscaling": {"type": "boolean"},
                "autoscalerOptions": {
                    "type": "object",
                    "properties": {
                        "version": {"enum": ["v1", "v2"]},
                        "upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"]},
                        "idleTimeoutSeconds": {"type": "integer", "minimum": 0},
                    },
                    "additionalProperties": False,
                },
                "headGroupSpec": {
                    "type": "object",
                    "required": ["rayStartParams", "template"],
                    "properties": {
                        "serviceType": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                        "rayStartParams": {"type": "object", "additionalProperties": {"type": "string"}},
                        "template": {"type": "object"},
                    },
                    "additionalProperties": False,
                },
                "workerGroupSpecs": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": [
                            "groupName",
                            "replicas",
                            "minReplicas",
                            "maxReplicas",
                            "rayStartParams",
                            "template",
                        ],
                        "properties": {
                            "groupName": {"type": "string", "pattern": "^[a-z0-9-]+$"},
                            "replicas": {"type": "integer", "minimum": 0},
                            "minReplicas": {"type": "integer", "minimum": 0},
                            "maxReplicas": {"type": "integer", "minimum": 1},
                            "rayStartParams": {"type": "object", "additionalProperties": {"type": "string"}},
                            "template": {"type": "object"},
                        },
                        "additionalProperties": False,
                    },
                },
            },
            "additionalProperties": False,
        },
    },
}


def _documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _all_documents() -> list[dict]:
    return [doc for path in MANIFESTS for doc in _documents(path)]


RAYJOB_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "spec": {
            "type": "object",
            "required": ["entrypoint", "rayClusterSpec", "shutdownAfterJobFinishes"],
            "properties": {
                "entrypoint": {"type": "string"},
                "shutdownAfterJobFinishes": {"type": "boolean"},
                "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
                "activeDeadlineSeconds": {"type": "integer", "minimum": 1},
                "backoffLimit": {"type": "integer", "minimum": 0},
                "submitterPodTemplate": {"type": "object"},
                "rayClusterSpec": RAYCLUSTER_SCHEMA["properties"]["spec"],
            },
            "additionalProperties": False,
        },
    },
}


def _as_pod(template: dict) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "template", **template.get("metadata", {})},
        "spec": template["spec"],
    }


def _ray_cluster_spec(doc: dict) -> dict | None:
    return {"RayCluster": doc.get("spec"), "RayJob": doc.get("spec", {}).get("rayClusterSpec")}.get(doc["kind"])


def _validate(doc: dict) -> None:
    """Strict schema validation of a core resource; KubeRay's resources are checked structurally, their pods
    strictly."""
    if doc["kind"] in {"RayCluster", "RayJob"}:
        jsonschema.validate(doc, RAYCLUSTER_SCHEMA if doc["kind"] == "RayCluster" else RAYJOB_SCHEMA)
        spec = _ray_cluster_spec(doc)
        templates = [group["template"] for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]]
        if "submitterPodTemplate" in doc["spec"]:
            templates.append(doc["spec"]["submitterPodTemplate"])
        for template in templates:
            kubernetes_validate.validate(_as_pod(template), K8S_VERSION, strict=True)
        for group in spec["workerGroupSpecs"]:
            assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
        return
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", MANIFESTS + TEMPLATES, ids=lambda p: p.name)
def test_manifest_is_schema_valid(path):
    documents = _documents(path)
    assert documents
    for doc in documents:
        _validate(doc)


def test_validation_rejects_a_broken_manifest():
    deployment = next(doc for doc in _all_documents() if doc["kind"] == "Deployment")
    broken = copy.deepcopy(deployment)
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(broken)
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(typo)
    raycluster = _raycluster("opentinker")
    bad_group = copy.deepcopy(raycluster)
    bad_group["spec"]["workerGroupSpecs"][0]["maxReplicas"] = "many"
    with pytest.raises(jsonschema.ValidationError):
        _validate(bad_group)


def _raycluster(name: str) -> dict:
    return next(doc for doc in _all_documents() if doc["kind"] == "RayCluster" and doc["metadata"]["name"] == name)


def test_raycluster_has_autoscaling_cpu_rollout_group_and_gpu_group():
    raycluster = _raycluster("opentinker")
    spec = raycluster["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    # v2, as `cluster up --autoscale`: it reports infeasible requests, which runs fail on (infra/autoscale.py)
    assert spec["autoscalerOptions"]["version"] == "v2" and spec["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    groups = {group["groupName"]: group for group in spec["workerGroupSpecs"]}
    cpu, gpu = groups["cpu-rollout"], groups["gpu-learner"]
    assert cpu["maxReplicas"] > cpu["minReplicas"] and "rollout_node" in cpu["rayStartParams"]["resources"]
    gpu_limits = gpu["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert gpu_limits["nvidia.com/gpu"] == gpu["rayStartParams"]["num-gpus"] == "1"
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no work scheduled on the head


@pytest.mark.parametrize("unit", ["kustomization", *(p.name for p in TEMPLATES)])
def test_references_resolve_and_kustomization_lists_every_manifest(unit):
    """What `kubectl apply -k` applies, and each per-job template on its own, refer only to objects (and keys of
    them) they define; every Service selects pods; the kustomization lists every manifest but the templates."""
    docs = _all_documents() if unit == "kustomization" else _documents(K8S_DIR / "per-job" / unit)
    defined = {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}
    pod_labels = []
    for doc in docs:
        if doc["kind"] in {"Deployment", "StatefulSet"}:
            pod_labels.append(doc["spec"]["template"]["metadata"]["labels"])
            assert (
                doc["spec"]["selector"]["matchLabels"].items() <= doc["spec"]["template"]["metadata"]["labels"].items()
            )
    for doc in docs:
        for kind, name, key in _refs(doc):
            target = defined.get((kind, name))
            assert target is not None, f"{doc['kind']}/{doc['metadata']['name']} refers to missing {kind}/{name}"
            if key is not None:
                keys = {**target.get("data", {}), **target.get("stringData", {})}
                assert key in keys, f"{doc['kind']}/{doc['metadata']['name']} refers to {kind}/{name} key {key}"
        if doc["kind"] == "Service":
            selector = doc["spec"]["selector"]
            assert any(selector.items() <= labels.items() for labels in pod_labels), (
                f"Service {doc['metadata']['name']} selects no pods"
            )
        if doc["kind"] == "Ingress":
            services = {name for kind, name in defined if kind == "Service"}
            backends = [
                path["backend"]["service"]["name"] for rule in doc["spec"]["rules"] for path in rule["http"]["paths"]
            ]
            assert set(backends) <= services, backends
    listed = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in MANIFESTS)


def _refs(node) -> list[tuple[str, str, str | None]]:
    """Every ConfigMap/Secret/PVC a manifest points at: (kind, name, the key it needs or None)."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "configMapRef":
                found.append(("ConfigMap", value["name"], None))
            elif key == "secretRef":
                found.append(("Secret", value["name"], None))
            elif key in {"secretKeyRef", "configMapKeyRef"}:
                found.append(("Secret" if key == "secretKeyRef" else "ConfigMap", value["name"], value["key"]))
            elif key == "persistentVolumeClaim":
                found.append(("PersistentVolumeClaim", value["claimName"], None))
            elif key in {"secret", "configMap"} and isinstance(value, dict) and {"secretName", "name"} & value.keys():
                kind, name = ("Secret", value["secretName"]) if key == "secret" else ("ConfigMap", value["name"])
                items = [item["key"] for item in value.get("items", [])]
                found += [(kind, name, item) for item in items] or [(kind, name, None)]
            found += _refs(value)
    elif isinstance(node, list):
        for item in node:
            found += _refs(item)
    return found


def test_config_map_alone_points_opentinker_at_the_cluster_services():
    config = next(
        doc for doc in _all_documents() if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == "opentinker-config"
    )
    fields = {name.upper() for name in Settings.model_fields}
    values = {
        key.removeprefix("OPENTINKER_").lower(): value
        for key, value in config["data"].items()
        if key.startswith("OPENTINKER_")
    }
    assert {key.upper() for key in values} <= fields, "every OPENTINKER_* key must be a Settings field"
    settings = Settings(**values)
    services = {doc["metadata"]["name"]: doc for doc in _all_documents() if doc["kind"] == "Service"}
    assert (
        settings.ray_address == "ray://opentinker-head-svc:10001"
    )  # KubeRay names the head service <cluster>-head-svc
    assert settings.tracking_uri == f"http://mlflow:{services['mlflow']['spec']['ports'][0]['port']}"
    assert (
        settings.prefect_api_url
        == f"http://prefect-server:{services['prefect-server']['spec']['ports'][0]['port']}/api"
    )
    assert settings.artifact_root == f"s3://{settings.s3_bucket}/mlflow"


def _pod_specs(doc: dict) -> list[dict]:
    """The pod specs a workload runs (a Deployment's, a RayJob's head, workers and submitter, ...)."""
    if doc["kind"] in {"Deployment", "StatefulSet"}:
        return [doc["spec"]["template"]["spec"]]
    spec = _ray_cluster_spec(doc)
    if spec is None:
        return []
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    extra = [doc["spec"]["submitterPodTemplate"]] if "submitterPodTemplate" in doc["spec"] else []
    return [template["spec"] for template in [*(group["template"] for group in groups), *extra]]


def _opentinker_argv(container: dict) -> list[str] | None:
    """The arguments of `opentinker` when the container runs it (itself, or behind `sh -c '... exec "$@"' sh`)."""
    argv = [*container.get("command", []), *container.get("args", [])]
    if argv[:1] == ["opentinker"]:
        return argv[1:]
    if argv[:2] == ["/bin/sh", "-c"] and argv[2].endswith('exec "$@"') and argv[4:5] == ["opentinker"]:
        return argv[5:]
    return None


def _parse(argv: list[str]) -> tuple[tuple[str, ...], dict]:
    """The subcommand path and parameters the real CLI makes of ``argv``, parsed (and converted) without running; a
    path-typed option's value as a ``Path``."""
    import click
    import typer.main

    from opentinker.cli import app

    command = typer.main.get_command(app)
    path: list[str] = []
    rest = list(argv)
    while isinstance(command, click.Group):
        name = rest.pop(0)
        command = command.commands[name]
        path.append(name)
    params = command.make_context(" ".join(["opentinker", *path]), rest).params
    for param in command.params:
        if isinstance(param.type, click.Path) and params[param.name] is not None:
            params[param.name] = Path(params[param.name])
    return tuple(path), params


def _server_containers() -> list[tuple[dict, dict, tuple[str, ...], dict]]:
    """(pod spec, container, subcommand path, parameters) of every container running `opentinker ...`."""
    found = []
    for doc in _all_documents() + [doc for path in TEMPLATES for doc in _documents(path)]:
        for pod in _pod_specs(doc):
            for container in pod["containers"]:
                argv = _opentinker_argv(container)
                if argv is not None:
                    found.append((pod, container, *_parse(argv)))
    return found


def test_every_opentinker_command_parses_with_the_real_cli_and_its_files_are_mounted():
    """The CLI's own parser (typer/click, strict: unknown options and bad values raise) accepts each container's
    command and the RayJob's entrypoint; every file an option names is a key of the Secret or ConfigMap mounted
    there."""
    import shlex

    import click

    commands = _server_containers()
    assert {path for _, _, path, _ in commands} == {("server", "up"), ("server", "worker")}
    for pod, container, path, params in commands:
        volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
        files = [value for value in params.values() if isinstance(value, Path)]
        assert files, path  # --config, --key-file
        for file in files:
            mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(file.parent))
            volume = volumes[mount["name"]]
            kind, source = ("Secret", volume["secret"]["secretName"]) if "secret" in volume else ("ConfigMap", None)
            owner = next(d for d in _all_documents() if (d["kind"], d["metadata"]["name"]) == (kind, source))
            assert file.name in {**owner.get("data", {}), **owner.get("stringData", {})}, (path, file)
        if path == ("server", "up"):
            assert params["host"] == "0.0.0.0" and not params["worker"] and params["config"] is not None
        else:
            assert params["server"] == "http://opentinker-api:8600" and params["limit"] == 1
    (rayjob,) = [doc for path in TEMPLATES for doc in _documents(path) if doc["kind"] == "RayJob"]
    assert _parse(shlex.split(rayjob["spec"]["entrypoint"])[1:])[0] == ("train",)
    with pytest.raises(click.UsageError):  # the parser is strict: a misspelt flag fails here, not in a pod
        _parse(["server", "up", "--no-workers"])


def _opentinker_variables(node, where: str = "") -> list[tuple[str, str]]:
    """(name, where) of every OPENTINKER_* a manifest sets: env names, ConfigMap and Secret keys."""
    found = []
    if isinstance(node, dict):
        if node.get("kind") in {"ConfigMap", "Secret"}:
            keys = {**node.get("data", {}), **node.get("stringData", {})}
            found += [(key, node["metadata"]["name"]) for key in keys if key.startswith("OPENTINKER_")]
        name = node.get("name")
        if isinstance(name, str) and name.startswith("OPENTINKER_") and ("value" in node or "valueFrom" in node):
            found.append((name, where))
        for value in node.values():
            found += _opentinker_variables(value, where)
    elif isinstance(node, list):
        for item in node:
            found += _opentinker_variables(item, where)
    return found


def _server_settings() -> dict:
    import tomllib

    secret = next(doc for doc in _all_documents() if doc["metadata"]["name"] == "opentinker-server")
    return tomllib.loads(secret["stringData"]["production.toml"])


def test_every_opentinker_variable_and_the_servers_settings_file_are_real_settings():
    from opentinker.serving.config import ServeSettings

    fields = set(Settings.model_fields)
    known = {f"OPENTINKER_{name.upper()}" for name in fields}
    known |= {f"OPENTINKER_SERVE_{name.upper()}" for name in ServeSettings.model_fields}  # the policy service's own
    docs = _all_documents() + [doc for path in TEMPLATES for doc in _documents(path)]
    variables = [item for doc in docs for item in _opentinker_variables(doc, doc["metadata"]["name"])]
    assert len(variables) > 20
    unknown = [(name, where) for name, where in variables if name not in known]
    assert not unknown, f"not settings: {unknown}"
    values = _server_settings()
    assert set(values) <= fields
    settings = Settings(**values)  # every value of the right type (extra="forbid": no stray key either)
    assert settings.mlflow_admin_username and settings.s3_admin_access_key and settings.server_database_url
    # The data dir lies on the shared volume, at the same path in every pod that mounts it.
    for pod, container, _, _ in _server_containers():
        data = next(v["name"] for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName"))
        mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == data)
        assert Path(values["data_dir"]).is_relative_to(mount)


def test_health_probes_hit_a_route_the_app_answers_without_a_key(tmp_path):
    """Each probe of a `server up` container is on the port it listens on, at a path the real app (started here on its
    own SQLite store) answers 200 without a key."""
    from fastapi.testclient import TestClient

    from opentinker.server.app import create_app

    probes = set()
    for _, container, path, params in _server_containers():
        if path != ("server", "up"):
            continue
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        for kind in ("readinessProbe", "livenessProbe"):
            probe = container[kind]["httpGet"]
            assert ports[probe["port"]] == params["port"], (container["name"], kind)
            probes.add(probe["path"])
    assert probes
    with TestClient(create_app(Settings(data_dir=tmp_path), jobs=False)) as client:
        for probe in probes:
            assert client.get(probe).status_code == 200, probe
        assert client.get("/v1/whoami").status_code == 401  # the probe's path is open; the others are not


def _kinds(docs: list[dict], *kinds: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] in kinds]


def test_server_pods_keep_off_the_shared_ray_cluster_and_workers_hold_only_their_key():
    """Neither the API nor the workers join the shared RayCluster (a server hands ray_address on to every job); the
    workers mount no server settings and set no credential; their pods are user-namespaced with no API token."""
    workloads = {doc["metadata"]["name"]: doc for doc in _kinds(_all_documents(), "Deployment")}
    for name in ("opentinker-api", "opentinker-worker"):
        refs = {(kind, ref) for kind, ref, _ in _refs(workloads[name])}
        assert ("ConfigMap", "opentinker-config") not in refs and ("Secret", "opentinker-s3") not in refs, name
        assert "OPENTINKER_RAY_ADDRESS" not in {v for v, _ in _opentinker_variables(workloads[name])}, name
    worker = workloads["opentinker-worker"]
    assert {(kind, ref) for kind, ref, _ in _refs(worker)} == {
        ("Secret", "opentinker-worker"),
        ("PersistentVolumeClaim", "opentinker-data"),
    }
    pod = worker["spec"]["template"]["spec"]
    assert pod["hostUsers"] is False and pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    assert container["securityContext"]["procMount"] == "Unmasked"  # bubblewrap mounts the job's own /proc
    assert not any(
        "KEY" in env["name"] or "PASSWORD" in env["name"] or "SECRET" in env["name"] for env in container["env"]
    )


def test_the_per_job_rayjob_is_a_cluster_of_its_own_that_reaches_only_mlflow_and_s3(tmp_path):
    import ray

    from opentinker.flows.validate import checked_spec
    from opentinker.server import mlflow_users, tenants

    text = (K8S_DIR / "per-job" / "rayjob.yaml").read_text().replace("TENANT", "acme").replace("JOB", "j1")
    docs = [doc for doc in yaml.safe_load_all(text) if doc]
    (rayjob,) = _kinds(docs, "RayJob")
    (policy,) = _kinds(docs, "NetworkPolicy")
    (config,) = _kinds(docs, "ConfigMap")
    (secret,) = _kinds(docs, "Secret")
    raycluster = _raycluster("opentinker")
    assert rayjob["spec"]["rayClusterSpec"]["rayVersion"] == raycluster["spec"]["rayVersion"] == ray.__version__
    assert rayjob["spec"]["shutdownAfterJobFinishes"] is True  # the cluster goes with the job
    # The tenant's own names and credentials, as the server derives them.
    assert config["data"]["OPENTINKER_MLFLOW_EXPERIMENT"] == tenants.experiment("acme")
    assert config["data"]["OPENTINKER_S3_PREFIX"] == tenants.s3_prefix("acme")
    assert secret["stringData"]["MLFLOW_TRACKING_USERNAME"] == mlflow_users.username("acme")
    assert "OPENTINKER_S3_ADMIN_ACCESS_KEY" not in {**config["data"], **secret["stringData"]}
    # Every pod of the job (head, workers, submitter) is the policy's, which admits only them and lets out only
    # what names a destination: no rule open to the world.
    selector = policy["spec"]["podSelector"]["matchLabels"]
    for pod in _pod_specs(rayjob):
        assert pod["automountServiceAccountToken"] is False
    templates = [g["template"] for g in [rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]]]
    templates += [g["template"] for g in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]]
    templates.append(rayjob["spec"]["submitterPodTemplate"])
    assert all(selector.items() <= t["metadata"]["labels"].items() for t in templates)
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": selector}}]}]
    assert all(rule.get("to") for rule in policy["spec"]["egress"])
    destinations = [
        peer.get("podSelector", {}).get("matchLabels") for r in policy["spec"]["egress"] for peer in r["to"]
    ]
    assert {"app.kubernetes.io/name": "prefect-server"} not in destinations
    # The job's own parameters are a valid run spec for the entrypoint's env, as `opentinker train` checks it.
    entry = rayjob["spec"]["entrypoint"].split()
    params = tmp_path / "params.toml"
    params.write_text(config["data"]["params.toml"])
    spec = checked_spec(entry[2], params)
    rollout = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert spec.engine.backend == "ray" and spec.engine.workers == rollout["replicas"]  # one actor per rollout pod
    cpus = float(rollout["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
    assert spec.rollout_num_cpus <= cpus


def test_the_tinker_engines_own_raycluster_holds_no_credential_and_the_api_pods_reach_it():
    """Every API replica serves /api/v1 through the one engine on its own RayCluster, named by the servers'
    settings (``tinker_ray_address``: its head service); its pods take no Secret, ConfigMap or credential variable,
    and mount the data volume where the API pods do (the engine writes tenants' checkpoints under data_dir)."""
    import ray

    engine = _raycluster("opentinker-tinker")
    assert engine["spec"]["rayVersion"] == ray.__version__
    settings = Settings(**_server_settings())
    assert settings.tinker_ray_address == f"{engine['metadata']['name']}-head-svc:6379"
    assert not {kind for kind, _, _ in _refs(engine)} & {"Secret", "ConfigMap"}
    spec = engine["spec"]
    (gpu,) = spec["workerGroupSpecs"]
    assert gpu["maxReplicas"] == 1 and gpu["rayStartParams"]["num-gpus"] == "1"  # one engine, placed on a GPU
    assert settings.tinker_device == "cuda"
    api = next(doc for doc in _kinds(_all_documents(), "Deployment") if doc["metadata"]["name"] == "opentinker-api")
    api_data = next(m for m in api["spec"]["template"]["spec"]["containers"][0]["volumeMounts"] if m["name"] == "data")
    for group in [spec["headGroupSpec"], gpu]:
        for container in group["template"]["spec"]["containers"]:
            names = {env["name"] for env in container.get("env", [])}
            assert not any(word in n for n in names for word in ("KEY", "PASSWORD", "SECRET", "TOKEN")), names
    (worker,) = gpu["template"]["spec"]["containers"]
    (data,) = [m for m in worker["volumeMounts"] if m["name"] == "data"]
    assert data["mountPath"] == api_data["mountPath"]
    ingress = next(doc for doc in _kinds(_all_documents(), "Ingress"))
    backends = {
        path["backend"]["service"]["name"] for rule in ingress["spec"]["rules"] for path in rule["http"]["paths"]
    }
    assert backends == {"opentinker-api"}
