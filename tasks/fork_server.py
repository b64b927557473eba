"""The data dir's warm processes: a process that has loaded once what a kind of child needs, and forks each later
child instead of a fresh interpreter loading it again. Two kinds (``Warm``):

- ``TRAINING``: torch, gymnasium and the RL core; it forks the training child of each ``opentinker train``
  (``training_process.TrainingProcess``). A fresh one spends ~2.5 s before its first env step (the interpreter,
  torch, and torch._dynamo, which the first optimiser imports); a fork builds its trainer in ~0.05 s.
- ``FLOW``: Prefect, MLflow's stores and flavours, the pipeline's flows, with the terminal's quiet settings; it
  forks the whole process of each later ``opentinker train`` (``cli.train``), which only parses its arguments and
  hands over its terminal: 3-4 s of imports and MLflow's package map, otherwise on every small run's critical path.

The first run in a data dir starts both as it ends (nothing waits for them); later runs ask them, over a Unix socket
in the data dir, to fork; a run that finds none (or one still starting) does the work itself as before. Each exits
after ``warm_process_idle_s`` without a request (0: never started), and at ``opentinker down``.

One server per data dir, kind and *key* (the socket's name): the interpreter, the newest change to the kind's code
and to the installed packages, and the environment variables read at import (threads, devices; for a flow also
Prefect's, MLflow's and the project's own settings). A caller whose key differs (another venv, edited code, other
settings) gets a server of its own, never a child built from stale code. What a child may differ in is sent with each
request and applied after the fork: the caller's arguments, environment, working directory and ``sys.path`` (a
user's ``package.module:Class`` env is imported in the child, never in the server), and its stdin, stdout and stderr
(passed as file descriptors, ``SCM_RIGHTS``). The server answers with the child's pid, then, when it has reaped the
child, its exit status; a child whose caller went away (its connection closed) is sent SIGTERM.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

MAX_REQUEST = 1 << 22
"""Bytes of one request (arguments, environment, import path): a caller is the server's own user, but still bounded."""
_IMPORT_TIME_ENV = ("OMP_", "MKL_", "KMP_", "OPENBLAS_", "CUDA_", "TORCH", "PYTORCH_", "LD_", "PYTHON")
_RL_CORE = ("opentinker", "opentinker.agents", "opentinker.envs", "opentinker.tasks", "opentinker.infra")


@dataclass(frozen=True)
class Warm:
    """A kind of warm process: what it loads before it listens, and what its key covers."""

    name: str
    warm_up: str
    """``module:function`` the server runs once before it listens (imports, per-process caches; nothing of a run)."""
    sources: tuple[str, ...]
    """The packages whose code its children run: an edit to any of them retires the key."""
    env_prefixes: tuple[str, ...]
    """Environment read while warming up: a server started with other values serves no one."""


TRAINING = Warm("training", "opentinker.tasks.training_process:warm_up", _RL_CORE, _IMPORT_TIME_ENV)
FLOW = Warm(
    "flow",
    "opentinker.flows.warm:warm_up",
    (*_RL_CORE, "opentinker.flows", "opentinker.federated", "opentinker.serving"),
    (*_IMPORT_TIME_ENV, "PREFECT_", "MLFLOW_", "OPENTINKER_", "RAY_", "GIT_", "HOME", "NO_COLOR", "TERM"),
)
FORKED = False
"""True in a child a warm process forked (its code need not ask for a fork itself)."""
_PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What a forked command's caller passes on to the fork (``run_forked``)."""


def socket_path(data_dir: Path, kind: Warm = TRAINING, env: Mapping[str, str] | None = None) -> Path:
    """Where the server of ``kind`` for this interpreter, code and environment (``env``, default this process's)
    listens, under ``data_dir``."""
    return data_dir / "training" / f"fork-{kind.name}-{_key(kind, os.environ if env is None else env)}.sock"


def _key(kind: Warm, env: Mapping[str, str]) -> str:
    """The interpreter, the newest change to the kind's code and to the installed packages (a site-packages folder
    changes with every install), and the environment read while warming up."""
    import importlib.util
    import site

    specs = [importlib.util.find_spec(name) for name in kind.sources]
    folders = [Path(folder) for spec in specs for folder in spec.submodule_search_locations]
    newest = max(path.stat().st_mtime_ns for folder in folders for path in folder.rglob("*.py"))
    environment = sorted((k, v) for k, v in env.items() if k.startswith(kind.env_prefixes))
    installed = [_changed(path) for path in site.getsitepackages() if os.path.isdir(path)]
    parts = [sys.executable, sys.version, *map(str, folders), str(newest), json.dumps(environment), *installed]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _changed(path: str) -> str:
    """What an install or an edit of ``path`` changes (not its access time)."""
    stat = os.stat(path)
    return f"{path}:{stat.st_ino}:{stat.st_mtime_ns}"


class ForkedChild:
    """A child forked by the server: ``pid``, its ``stdin`` (write) and ``stdout`` (read) pipes, ``wait()``."""

    def __init__(self, connection: socket.socket, answers: IO[str], pid: int, stdin: IO[str], stdout: IO[str]):
        self._connection, self._answers = connection, answers
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode: int | None = None

    def wait(self) -> int | None:
        """The child's exit status, as the server reaped it (negative: the signal that ended it; None: the server
        died first)."""
        if self.returncode is None:
            line = self._answers.readline()
            self.returncode = json.loads(line)["exit"] if line else None
            self._answers.close()
            self._connection.close()
        return self.returncode


def fork_child(data_dir: Path, argv: list[str]) -> ForkedChild | None:
    """``module.main(argv)`` run by a child the data dir's warm training process forks, for ``argv = [module,
    *args]`` (what ``python -m module args...`` runs, for a module whose ``__main__`` block calls ``main(sys.argv)``),
    talking over pipes; None when no server listens (none started, still starting, idle-exited, another key)."""
    child_stdin, stdin = os.pipe()
    stdout, child_stdout = os.pipe()
    try:
        asked = _ask(data_dir, TRAINING, argv[0], argv, [child_stdin, child_stdout, 2])
    finally:
        os.close(child_stdin)
        os.close(child_stdout)
    if asked is None:
        for fd in (stdin, stdout):
            os.close(fd)
        return None
    return ForkedChild(*asked, os.fdopen(stdin, "w"), os.fdopen(stdout, "r"))


def run_forked(data_dir: Path, kind: Warm, module: str, argv: list[str], env: Mapping[str, str]) -> int | None:
    """This process's work, ``module.main(argv)``, done by a child of the data dir's warm process of ``kind`` on
    this process's stdin, stdout and stderr, with ``env`` (this process's environment before it changed any);
    Ctrl-C, SIGTERM and SIGHUP are passed on to it. Its exit status (a signal's as 128 + its number), or None when
    no server listens (the caller does the work)."""
    asked = _ask(data_dir, kind, module, argv, [0, 1, 2], env)
    if asked is None:
        return None
    connection, answers, pid = asked

    def pass_on(number: int, _frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):  # it has just exited
            os.kill(pid, number)

    passed = {n: signal.signal(n, pass_on) for n in _PASSED_ON if signal.getsignal(n) is not signal.SIG_IGN}
    try:
        line = answers.readline()
    finally:
        for number, handler in passed.items():
            signal.signal(number, handler)
        answers.close()
        connection.close()
    code = json.loads(line)["exit"] if line else 1
    return 128 - code if code < 0 else code


def _ask(
    data_dir: Path, kind: Warm, module: str, argv: list[str], fds: list[int], env: Mapping[str, str] | None = None
) -> tuple[socket.socket, IO[str], int] | None:
    """Ask the server of ``kind`` to fork a child running ``module.main(argv)`` on ``fds`` (its 0, 1, 2): the
    connection, its reader and the child's pid; None when no server answers."""
    env = dict(os.environ if env is None else env)
    path = socket_path(data_dir, kind, env)
    try:
        request = {"module": module, "argv": argv, "env": env, "cwd": os.getcwd(), "path": sys.path}
    except FileNotFoundError:  # a working directory removed under the caller: nothing to chdir to in a fork
        return None
    if not path.exists():
        return None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _address(path) as address:
            connection.connect(address)
        socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], fds)
        answers = connection.makefile("r")  # the pid now, the exit status later: one reader for both
        return connection, answers, json.loads(answers.readline())["pid"]
    except (OSError, ValueError, KeyError):  # none listens, or it went away meanwhile: the caller does the work
        connection.close()
        return None


def start_server(data_dir: Path, idle_s: float, kind: Warm = TRAINING, env: Mapping[str, str] | None = None) -> None:
    """Start the data dir's server of ``kind`` in the background, with ``env`` (default this process's), unless one
    listens (the caller does not wait for it)."""
    env = dict(os.environ if env is None else env)
    path = socket_path(data_dir, kind, env)
    if idle_s <= 0 or _listening(path):
        return
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(path.parent / "fork-server.log", "ab") as log_file:
        subprocess.Popen(
            # -P: the starting command's folder is not on its import path (a file there must not shadow a package)
            [sys.executable, "-P", "-m", __name__, str(path), str(idle_s), kind.name],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,  # not the starting command's: it outlives it, and its Ctrl-C
        )


def wait_ready(
    data_dir: Path, timeout: float = 60.0, kind: Warm = TRAINING, env: Mapping[str, str] | None = None
) -> bool:
    """Whether the data dir's server of ``kind`` for ``env`` (default this process's) listens within ``timeout`` s
    (benches and tests; runs never wait)."""
    deadline, path = time.monotonic() + timeout, socket_path(data_dir, kind, env)  # the key's walk, once
    while not _listening(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def stop_servers(data_dir: Path) -> int:
    """Stop every warm process of the data dir (``opentinker down``); how many were listening."""
    stopped = 0
    for path in (data_dir / "training").glob("fork-*.sock"):
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            with _address(path) as address:
                connection.connect(address)
            connection.sendall(b'{"stop": true}\n')
            connection.recv(1)  # closed once the server has stopped taking requests
            stopped += 1
            deadline = time.monotonic() + 10
            while path.exists() and time.monotonic() < deadline:  # then it removes its socket and exits
                time.sleep(0.02)
    return stopped


@contextlib.contextmanager
def _address(path: Path) -> Iterator[str]:
    """``path`` as a socket address of at most ~30 bytes, through the open folder (``/proc/self/fd/N/name``): a Unix
    socket's address holds 107 bytes, fewer than a deep data dir's path."""
    folder = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{folder}/{path.name}"
    finally:
        os.close(folder)


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            with _address(path) as address:
                probe.connect(address)
        except OSError:
            return False
        probe.sendall(b'{"ping": true}\n')
        return True


def serve(path: Path, idle_s: float, kind: Warm) -> None:
    """Warm up, listen at ``path``, fork a child per request and report each child's exit; exit after ``idle_s``
    without a request or a running child. A second server of the same key (two runs ended together) leaves at once."""
    import fcntl
    import importlib

    lock = open(path.with_suffix(".lock"), "a")  # held for the server's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return
    module, function = kind.warm_up.split(":")
    getattr(importlib.import_module(module), function)()
    if threading.active_count() != 1:  # a fork copies one thread: another's locks could be held forever in a child
        raise RuntimeError(f"warming up left threads running: {threading.enumerate()}")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a dead server's socket
    with _address(path) as address:
        listener.bind(address)
    os.chmod(path, 0o600)
    listener.listen(16)
    children: dict[int, socket.socket] = {}
    exited, wakeup = socket.socketpair()  # a child's exit wakes the loop (SIGCHLD), so its caller hears at once
    wakeup.setblocking(False)
    signal.set_wakeup_fd(wakeup.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(exited, selectors.EVENT_READ)
    last_request = time.monotonic()
    try:
        while children or time.monotonic() - last_request < idle_s:
            for key, _ in selector.select(timeout=1.0):
                if key.fileobj is exited:
                    exited.recv(4096)
                elif key.fileobj is listener:
                    connection, _ = listener.accept()
                    if not _handle(connection, children, selector):
                        return
                    last_request = time.monotonic()
                elif not _recv_or_eof(key.fileobj):  # a child's caller went away: the child goes too
                    selector.unregister(key.fileobj)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(key.data, signal.SIGTERM)
            _reap(children, selector)
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        listener.close()


def _recv_or_eof(connection: socket.socket) -> bool:
    """Whether the caller is still there (callers send nothing after their request: readable means gone)."""
    try:
        return bool(connection.recv(1, socket.MSG_DONTWAIT))
    except BlockingIOError:
        return True
    except OSError:
        return False


def _handle(connection: socket.socket, children: dict[int, socket.socket], selector: selectors.BaseSelector) -> bool:
    """One request: fork a child (its connection kept for the exit report), a ping, or stop (False)."""
    fds: list[int] = []
    try:
        connection.settimeout(10)
        message, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
        while message and not message.endswith(b"\n") and len(message) < MAX_REQUEST:  # a stream: the rest follows
            message += connection.recv(1 << 16) or b"\n"
        request = json.loads(message)
        if isinstance(request, dict) and request.get("stop"):
            return False
        if isinstance(request, dict) and "argv" in request and len(fds) == 3:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(request, fds)  # never returns
            children[pid], connection = connection, None  # reaped and reported whether or not the caller stays
            children[pid].sendall(json.dumps({"pid": pid}).encode() + b"\n")
            selector.register(children[pid], selectors.EVENT_READ, pid)
    except (OSError, ValueError):
        pass  # a caller that went away, or sent what is not a request
    finally:
        for fd in fds:
            os.close(fd)
        if connection is not None:
            connection.close()
    return True


def _child(request: dict[str, Any], fds: list[int]) -> None:
    """In the fork: become the caller's process (descriptors, environment, directory, import path, fresh random
    state, a fresh interpreter's signal handling), then run the module's ``main(argv)``."""
    import importlib

    global FORKED
    FORKED = True
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the server's socket, lock and other children's connections
        signal.set_wakeup_fd(-1)  # the server's, closed above
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the one handler the server changed
        # What the server inherited from the command that started it (a script's background job ignores SIGINT and
        # SIGQUIT, `nohup` SIGHUP) is not this caller's: it passes on only what it does not ignore itself.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(number, signal.SIG_DFL)
        os.setsid()
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.path[:] = request["path"]
        random.seed()
        with contextlib.suppress(ImportError):
            import numpy as np

            np.random.seed()
        from opentinker.infra.settings import get_settings

        get_settings.cache_clear()
        sys.argv = list(request["argv"])
        importlib.import_module(request["module"]).main(sys.argv)  # preloaded, or the caller's module imported here
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(children: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    """Report each exited child's status on its request's connection (negative: the signal that ended it)."""
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            connection = children.pop(pid)
            with contextlib.suppress(KeyError, ValueError):
                selector.unregister(connection)
            with contextlib.suppress(OSError):
                connection.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            connection.close()


if __name__ == "__main__":  # the server runs this module's imported copy, whose ``FORKED`` its children's code reads
    from opentinker.tasks import fork_server

    kinds = {kind.name: kind for kind in (fork_server.TRAINING, fork_server.FLOW)}
    fork_server.serve(Path(sys.argv[1]), float(sys.argv[2]), kinds[sys.argv[3]])
