"""The data dir's training fork server: a process that has imported torch, gymnasium and the RL core once, and forks
the training child of each later ``opentinker train`` (``training_process.TrainingProcess``) instead of a fresh
interpreter importing them again.

Why: a fresh training child spends ~2.5 s before its first env step (the interpreter, torch, and torch._dynamo,
which the first optimiser imports), all of it on a run's critical path, while a fork of a process that already
imported them builds its trainer in ~0.05 s. The first run in a data dir starts the server as it ends (nothing waits
for it); later runs ask it, over a Unix socket in the data dir, to fork their child; a run that finds none (or one
still starting) starts its child as before. It exits after ``training_fork_server_idle_s`` without a request (0:
never started), and at ``opentinker down``.

One server per data dir and *key* (the socket's name): the interpreter, the files of the packages it preloaded and
the environment variables torch reads at import (threads, devices). A run whose key differs (another venv, edited
code, other thread settings) gets a server of its own, never a child built from stale code. What a child may differ
in is sent with each request and applied after the fork: the caller's arguments, environment, working directory and
``sys.path`` (a user's ``package.module:Class`` env is imported in the child, never in the server), and its stdin,
stdout and stderr (passed as file descriptors, ``SCM_RIGHTS``). The server answers with the child's pid, then, when it
has reaped the child, its exit status.
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
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

PRELOAD = (
    "torch",
    "torch._dynamo",
    "gymnasium",
    "opentinker.agents.build",
    "opentinker.agents.export",
    "opentinker.tasks.training_process",
)
"""What a training child imports before its first env step (torch._dynamo: the first optimiser's import)."""
KEY_ENV_PREFIXES = ("OMP_", "MKL_", "KMP_", "OPENBLAS_", "CUDA_", "TORCH", "PYTORCH_", "LD_", "PYTHON")
"""Environment read at import time by what ``PRELOAD`` loads: a server started with other values serves no one."""
MAX_REQUEST = 1 << 22
"""Bytes of one request (arguments, environment, import path): a caller is the server's own user, but still bounded."""
SOURCES = ("opentinker", "opentinker.agents", "opentinker.envs", "opentinker.tasks", "opentinker.infra")
"""The packages whose code a training child runs: an edit to any of them retires the server's key."""


def socket_path(data_dir: Path) -> Path:
    """Where the server for this interpreter, code and environment listens, under ``data_dir``."""
    return data_dir / "training" / f"fork-{_key()}.sock"


def _key() -> str:
    """The interpreter, the newest change to the code a child runs (the RL core's packages) and the installed
    torch, gymnasium and numpy, and the import-time environment."""
    import importlib.util

    folders = [Path(folder) for name in SOURCES for folder in importlib.util.find_spec(name).submodule_search_locations]
    newest = max(path.stat().st_mtime_ns for folder in folders for path in folder.rglob("*.py"))
    environment = sorted((k, v) for k, v in os.environ.items() if k.startswith(KEY_ENV_PREFIXES))
    installed = [_changed(importlib.util.find_spec(name).origin) for name in ("torch", "gymnasium", "numpy")]
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
    """``module.main(argv)`` run by a child the data dir's server forks, for ``argv = [module, *args]`` (what
    ``python -m module args...`` runs, for a module whose ``__main__`` block calls ``main(sys.argv)``); None when no
    server listens (none started, still starting, idle-exited, another key)."""
    path = socket_path(data_dir)
    try:
        request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "path": sys.path}
    except FileNotFoundError:  # a working directory removed under the caller: nothing to chdir to in a fork
        return None
    if not path.exists():
        return None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _address(path) as address:
            connection.connect(address)
    except OSError:
        connection.close()
        return None
    child_stdin, stdin = os.pipe()
    stdout, child_stdout = os.pipe()
    try:
        socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], [child_stdin, child_stdout, 2])
        answers = connection.makefile("r")  # the pid now, the exit status later: one reader for both
        pid = json.loads(answers.readline())["pid"]
    except (OSError, ValueError, KeyError):  # the server went away meanwhile: start the child fresh
        for fd in (stdin, stdout):
            os.close(fd)
        connection.close()
        return None
    finally:
        os.close(child_stdin)
        os.close(child_stdout)
    return ForkedChild(connection, answers, pid, os.fdopen(stdin, "w"), os.fdopen(stdout, "r"))


def start_server(data_dir: Path, idle_s: float) -> None:
    """Start the data dir's server in the background unless one listens (the caller does not wait for it)."""
    path = socket_path(data_dir)
    if idle_s <= 0 or _listening(path):
        return
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(path.parent / "fork-server.log", "ab") as log_file:
        subprocess.Popen(
            [sys.executable, "-m", __name__, str(path), str(idle_s)],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,  # not the starting command's: it outlives it, and its Ctrl-C
        )


def wait_ready(data_dir: Path, timeout: float = 60.0) -> bool:
    """Whether the data dir's server listens within ``timeout`` s (benches and tests; runs never wait)."""
    deadline = time.monotonic() + timeout
    while not _listening(socket_path(data_dir)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def stop_servers(data_dir: Path) -> int:
    """Stop every fork server of the data dir (``opentinker down``); how many were listening."""
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


def serve(path: Path, idle_s: float) -> None:
    """Preload, listen at ``path``, fork a child per request and report each child's exit; exit after ``idle_s``
    without a request or a running child. A second server of the same key (two runs ended together) leaves at once."""
    import fcntl
    import importlib

    lock = open(path.with_suffix(".lock"), "a")  # held for the server's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return
    for name in PRELOAD:
        importlib.import_module(name)
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
                    continue
                connection, _ = listener.accept()
                if not _handle(connection, children):
                    return
                last_request = time.monotonic()
            _reap(children)
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        listener.close()


def _handle(connection: socket.socket, children: dict[int, socket.socket]) -> bool:
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

    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the server's socket, lock and other children's connections
        signal.set_wakeup_fd(-1)  # the server's, closed above
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the one handler the server changed
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
        importlib.import_module(sys.argv[0]).main(sys.argv)  # preloaded, or the caller's module imported here
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


def _reap(children: dict[int, socket.socket]) -> None:
    """Report each exited child's status on its request's connection (negative: the signal that ended it)."""
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            connection = children.pop(pid)
            with contextlib.suppress(OSError):
                connection.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            connection.close()


if __name__ == "__main__":
    serve(Path(sys.argv[1]), float(sys.argv[2]))
