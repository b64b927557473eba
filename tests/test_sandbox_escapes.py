"""Escape attempts through the public tool, ``PythonREPL().invoke({"code": ...})``: each must fail and leave nothing.

Most attempts run twice: as written (the in-process audit guard refuses most of them) and after the guard has
been disarmed by rewriting its closure (the issue's third reproduction), which shows the OS boundary (bubblewrap
namespaces, read-only filesystem, seccomp, limits) holds on its own. After every call no process the call
started may remain.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from opentinker.infra.settings import get_settings
from opentinker.llm import (
    PythonREPL,
    SandboxLimits,
    SandboxUnavailable,
    run_python,
)
from opentinker.llm import sandbox as sandbox_module

LIMITS = SandboxLimits(wall_time_s=3, memory_mb=256, max_output_chars=6000, max_processes=8, disk_mb=16)
SECRET = f"opentinker-secret-{secrets.token_hex(8)}"
PROJECT_FILE = Path(sandbox_module.__file__).resolve()
PROJECT_MARKER = 'SANDBOX_PACKAGES = ("numpy"'  # a line of the project's source, never printed legitimately
DISARM = """import gc
g = [o for o in gc.get_objects() if getattr(o, "__name__", "") == "guard" and hasattr(o, "__closure__")][0]
d = dict(zip(g.__code__.co_freevars, g.__closure__))
d["blocked_prefixes"].cell_contents = ("\\0",)
d["writable_root"].cell_contents = "/"
"""
LEAKS = ("root:x:0:0", "uid=", SECRET, PROJECT_MARKER, "ESCAPED")
TRY = """
def attempt(label, f):
    try:
        print(label, "->", f())
    except BaseException as exc:
        print(label, "refused:", type(exc).__name__, exc)
"""


@pytest.fixture(autouse=True)
def _secret_in_environment(monkeypatch):
    monkeypatch.setenv("OPENTINKER_TEST_SECRET", SECRET)


def sandbox_processes(since: float) -> list[psutil.Process]:
    """Live host processes of a sandbox started at ``since`` or later: bwrap itself or in a PID namespace other than
    ours, and either ours (descendants of this process) or orphans adopted by init — where an escaped process would
    end up.

    Not only ``psutil.Process().children()``: the suite's session services (Ray, MLflow, ...) are this process's
    children and start helpers of their own at any time; not every sandbox on the host either: other programs
    (another test run, a server's job sandboxes) run their own."""
    own = os.readlink("/proc/self/ns/pid")
    ours = {child.pid for child in psutil.Process().children(recursive=True)}
    found = []
    for proc in psutil.process_iter(["cmdline", "status", "ppid", "create_time"]):
        try:
            namespace = os.readlink(f"/proc/{proc.pid}/ns/pid")
        except OSError:
            continue  # gone, or not ours to read
        if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.info["create_time"] < since:
            continue  # dead (a namespace's init waits to be reaped by the host's init after bwrap exits), or older
        cmdline = proc.info["cmdline"] or [""]
        sandboxed = namespace != own or os.path.basename(cmdline[0]) == "bwrap"
        if sandboxed and (proc.pid in ours or proc.info["ppid"] == 1):
            found.append(proc)
    return found


def invoke(code: str, guard: str = "on") -> str:
    """Run through the public tool; assert nothing the call started is still alive and no known secret leaked."""
    started = time.time() - 1.0  # process start times are rounded to clock ticks
    out = PythonREPL(limits=LIMITS).invoke({"code": (DISARM if guard == "disarmed" else "") + TRY + code})
    assert sandbox_processes(started) == [], "a process of the call outlived it"
    for leak in LEAKS:
        assert leak not in out, f"leaked {leak!r}:\n{out}"
    return out


# --- the five reproductions, verbatim -------------------------------------------------------------


def test_cffi_system_call():
    out = invoke(
        'import cffi,sys; f=cffi.FFI(); f.cdef("int system(const char*);"); sys.stdout.flush(); '
        'f.dlopen(None).system(b"id; head -2 /etc/passwd")'
    )
    assert "ModuleNotFoundError" in out  # cffi is not in the sandbox; the ctypes equivalent is tried below


def test_guard_helper_replaced():
    out = invoke(
        'import os,posixpath; wd=os.getcwd(); posixpath.realpath=lambda p,*a,**k: wd+"/x"; '
        'print(open("/etc/passwd").read())'
    )
    assert "FileNotFoundError" in out  # the guard was fooled; the filesystem has no /etc


def test_guard_closure_rewritten():
    out = invoke(
        'import gc; g=[o for o in gc.get_objects() if getattr(o,"__name__","")=="guard" and '
        'hasattr(o,"__closure__")][0]; d=dict(zip(g.__code__.co_freevars,g.__closure__)); '
        'd["blocked_prefixes"].cell_contents=("\\0",); d["writable_root"].cell_contents="/"; '
        'import subprocess; print(subprocess.run(["id"],capture_output=True).stdout)'
    )
    assert "FileNotFoundError" in out  # guard gone, but there is no `id` (nor any binary but python)


def test_posixsubprocess_fork_exec():
    out = invoke("""import _posixsubprocess, os
r, w = os.pipe()
pid = _posixsubprocess.fork_exec(["/bin/sh", "-c", "id"], [b"/bin/sh"], True, (), None, None, -1, -1, -1, -1,
                                 -1, -1, r, w, False, False, -1, None, None, None, -1, None, False)
os.close(w)
print("child error:", os.read(r, 200))
print("status:", os.waitpid(pid, 0))
""")
    assert "status: (" in out and not out.rstrip().endswith(", 0)")  # the guard did not see it; exec failed


def test_multiprocessing_spawn_runs_inside_the_boundary():
    out = invoke("""import multiprocessing as mp
mp.get_context("spawn").Process(target=print, args=("ran",)).start()
p = mp.get_context("spawn").Process(target=exec, args=("print(open('/etc/passwd').read())",)); p.start(); p.join()
print("exitcode", p.exitcode)
""")
    # the unguarded child starts, but only inside the sandbox: it finds no /etc
    assert "ran" in out and "FileNotFoundError" in out and "exitcode 1" in out, out


@pytest.mark.parametrize("guard", ["on", "disarmed"])
def test_process_limit_holds_for_any_uid(guard):
    started = time.monotonic()
    out = invoke(
        """import os
n = 0
try:
    while n < 200:
        if os.fork() == 0:
            import time; time.sleep(30)
        n += 1
except BaseException as exc:
    print("stopped after", n, type(exc).__name__)
""",
        guard,
    )
    assert "stopped after" in out
    assert int(out.split("stopped after")[1].split()[0]) < LIMITS.max_processes
    assert time.monotonic() - started < LIMITS.wall_time_s + 10


# --- reading the host -----------------------------------------------------------------------------------

HOST_READS = {
    "etc_passwd": "print(open('/etc/passwd').read())",
    "project_source": f"print(open({str(PROJECT_FILE)!r}).read())",
    "project_dir": f"print(os.listdir({str(PROJECT_FILE.parents[2])!r}))",
    "venv_config": f"print(open({str(Path(sys.prefix) / 'pyvenv.cfg')!r}).read())",
    "home": f"print(os.listdir({os.path.expanduser('~')!r}))",
    "root_listing": "print(os.listdir('/'))",
    "environment": "print(dict(os.environ)); print(open('/proc/self/environ', 'rb').read())",
    "pid1_environment": "print(open('/proc/1/environ', 'rb').read())",
    "parent_environment": "print(open(f'/proc/{os.getppid()}/environ', 'rb').read())",
    "host_pid_environment": f"print(open('/proc/{os.getpid()}/environ', 'rb').read())",
    "proc_root_traversal": "print(os.listdir('/proc/1/root')); print(open('/proc/1/root/etc/passwd').read())",
    "symlink_to_host": "os.symlink('/etc/passwd', '/tmp/l'); print(open('/tmp/l').read())",
    "proc_self_exe": (
        "import subprocess; print(subprocess.run(['/proc/self/exe', '-c', "
        "'print(open(\"/etc/passwd\").read())'], capture_output=True))"
    ),
}


@pytest.mark.parametrize("guard", ["on", "disarmed"])
@pytest.mark.parametrize("name", sorted(HOST_READS))
def test_host_files_and_environment_are_out_of_reach(name, guard):
    out = invoke(f"import os\nattempt({name!r}, lambda: exec({HOST_READS[name]!r}, globals()))", guard)
    assert "refused" in out or name in (
        "root_listing",
        "home",
        "environment",
        "pid1_environment",
        "parent_environment",
        "proc_self_exe",
    )
    host_only = set(os.listdir(os.path.expanduser("~"))) - {Path(os.path.realpath(sys.executable)).parts[2]}
    if name == "home":
        assert not any(f"'{entry}'" in out for entry in host_only), out
    if name == "root_listing" and guard == "disarmed":
        assert "'etc'" not in out and "'work'" not in out and "'home'" not in out, out


# --- writing outside -------------------------------------------------------------------------------------


@pytest.mark.parametrize("guard", ["on", "disarmed"])
def test_writes_outside_the_sandbox_fail_and_leave_nothing(guard, tmp_path):
    targets = [
        tmp_path / "marker",
        PROJECT_FILE.parent / f"marker-{secrets.token_hex(4)}",
        Path("/etc/marker"),
        Path("/usr/lib/marker"),
        Path("/dev/shm/marker"),
        Path("/marker"),
    ]
    code = "".join(f"attempt({str(p)!r}, lambda: open({str(p)!r}, 'w').write('x'))\n" for p in targets)
    code += (
        "attempt('sysctl', lambda: os.close(os.open('/proc/sys/kernel/core_pattern', os.O_WRONLY)))\n"
        "attempt('proc_self', lambda: os.close(os.open('/proc/self/oom_score_adj', os.O_WRONLY)))\n"
    )
    out = invoke("import os\n" + code, guard)
    assert out.count("refused") == len(targets) + 2, out
    assert not any(p.exists() for p in targets)


# --- every process-creation path ---------------------------------------------------------------------------

SPAWNS = {
    "subprocess": "import subprocess; print(subprocess.run(['id'], capture_output=True))",
    "os_system": "print(os.system('id; cat /etc/passwd'))",
    "os_popen": "print(os.popen('id').read())",
    "os_fork_exec": (
        "pid = os.fork()\nif pid == 0:\n    os.execv('/bin/sh', ['sh', '-c', 'id'])\nprint(os.waitpid(pid, 0))"
    ),
    "os_execv": "os.execv('/usr/bin/id', ['id'])",
    "posix_spawn": "print(os.waitpid(os.posix_spawn('/usr/bin/id', ['id'], {}), 0))",
    "posix_spawnp": "print(os.waitpid(os.posix_spawnp('id', ['id'], {}), 0))",
    "forkpty": "pid, fd = os.forkpty()\nif pid == 0:\n    os.execv('/bin/sh', ['sh'])\nprint(pid)",
    "pty_spawn": "import pty; pty.spawn(['/bin/sh', '-c', 'id'])",
    "asyncio": (
        "import asyncio\nasync def main():\n    p = await asyncio.create_subprocess_exec('id')\n"
        "    print(await p.wait())\nasyncio.run(main())"
    ),
    "ctypes_system": "import ctypes; print(ctypes.CDLL(None).system(b'id; cat /etc/passwd'))",
    "ctypes_execve": "import ctypes; print(ctypes.CDLL(None).execv(b'/bin/sh', None))",
    "multiprocessing_fork": (
        "import multiprocessing as mp; p = mp.get_context('fork').Process("
        "target=lambda: print(open('/etc/passwd').read())); p.start(); p.join()"
    ),
    "python_child": (
        "import subprocess, sys; print(subprocess.run([sys.executable, '-c', "
        "'print(open(\"/etc/passwd\").read())'], capture_output=True))"
    ),
}


@pytest.mark.parametrize("guard", ["on", "disarmed"])
@pytest.mark.parametrize("name", sorted(SPAWNS))
def test_process_creation_paths_reach_nothing(name, guard):
    out = invoke(f"import os\nattempt({name!r}, lambda: exec({SPAWNS[name]!r}, globals()))", guard)
    assert f"{name} ->" in out or f"{name} refused:" in out, out  # the attempt really ran


# --- host processes: seeing, signalling, surviving ---------------------------------------------------------


@pytest.mark.parametrize("guard", ["on", "disarmed"])
def test_host_processes_are_invisible_and_unsignallable(guard):
    since = time.time() - 1.0  # process start times are rounded to clock ticks
    received: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, _: received.append(signum))
    canary = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        code = (
            TRY
            + f"""import os, signal
attempt("pids", lambda: sorted(p for p in os.listdir("/proc") if p.isdigit()))
attempt("kill_test", lambda: os.kill({os.getpid()}, signal.SIGUSR1))
attempt("kill_canary", lambda: os.kill({canary.pid}, signal.SIGKILL))
attempt("kill_all", lambda: os.kill(-1, signal.SIGKILL))
"""
        )  # not invoke(): the canary is this test's own child
        out = PythonREPL(limits=LIMITS).invoke({"code": (DISARM if guard == "disarmed" else "") + code})
        assert canary.poll() is None, "a host process was killed from the sandbox"
        assert received == []
        assert f"'{os.getpid()}'" not in out and f"'{canary.pid}'" not in out
        if guard == "disarmed":
            pids = out.split("pids ->")[1].split("\n")[0]
            assert len(eval(pids)) <= 3, out  # its own namespace: bwrap's init, the python, maybe a helper
    finally:
        canary.kill()
        canary.wait()
        signal.signal(signal.SIGUSR1, previous)
    assert sandbox_processes(since) == []


@pytest.mark.parametrize("guard", ["on", "disarmed"])
def test_nothing_survives_the_call(guard, tmp_path):
    token = secrets.token_hex(8)
    invoke(
        f"""import os, sys
def daemon():
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(30)  # {token}"])
        os._exit(0)
attempt("daemon", daemon)
""",
        guard,
    )
    assert not [p for p in psutil.process_iter(["cmdline"]) if token in " ".join(p.info["cmdline"] or ())]


def test_sandbox_dies_with_a_killed_caller():
    """--die-with-parent: a caller killed mid-call (SIGKILL, no cleanup) takes the whole sandbox with it."""
    token = secrets.token_hex(8)
    code = (
        DISARM
        + f"""import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # {token}"])
time.sleep(60)"""
    )
    cgroups = set(Path("/sys/fs/cgroup/pids").glob("opentinker-sandbox-*"))
    call = f"from opentinker.llm import SandboxLimits, run_python; run_python({code!r}, SandboxLimits(60))"
    caller = subprocess.Popen([sys.executable, "-c", call])

    def sandboxed() -> list[psutil.Process]:  # the caller's own command line holds the token too
        return [
            p
            for p in psutil.process_iter(["cmdline"])
            if token in " ".join(p.info["cmdline"] or ()) and p.pid != caller.pid
        ]

    try:
        deadline = time.monotonic() + 60
        while not sandboxed():
            assert caller.poll() is None and time.monotonic() < deadline, "the sandboxed child never started"
            time.sleep(0.05)
    finally:
        caller.kill()
        caller.wait()
    deadline = time.monotonic() + 10
    while sandboxed() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sandboxed(), "the sandbox outlived its killed caller"
    for leftover in set(Path("/sys/fs/cgroup/pids").glob("opentinker-sandbox-*")) - cgroups:
        # A killed process leaves the cgroup only once reaped (a zombie has no command line, so ``sandboxed()`` no
        # longer sees it, but the kernel still counts it): the cgroup empties by itself, then it can be removed.
        while (leftover / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not (leftover / "cgroup.procs").read_text().strip(), "the sandbox's processes outlived its caller"
        leftover.rmdir()  # a killed caller cannot remove its (now empty) cgroup


# --- resource exhaustion -----------------------------------------------------------------------------------


@pytest.mark.parametrize("guard", ["on", "disarmed"])
def test_memory_hog_is_stopped(guard):
    out = invoke("attempt('hog', lambda: len(bytearray(3 * 1024 ** 3)))", guard)
    assert "MemoryError" in out


@pytest.mark.parametrize("guard", ["on", "disarmed"])
def test_disk_filler_hits_the_tmpfs_cap(guard):
    out = invoke(
        """import os
written = 0
def fill():
    global written
    for i in range(100):
        with open(f"/tmp/fill{i}", "wb") as f:
            for _ in range(8):
                f.write(b"x" * 1024 * 1024)
                written += 1
attempt("fill", fill)
print("written_mb", written)
""",
        guard,
    )
    assert "No space left" in out or "File too large" in out, out
    assert int(out.split("written_mb")[1].split()[0]) <= LIMITS.disk_mb


def test_output_flood_is_cut_and_killed():
    since = time.time() - 1.0  # process start times are rounded to clock ticks
    started = time.monotonic()
    result = run_python("while True:\n    print('y' * 10_000)", LIMITS)
    assert result.truncated and len(result.output) <= LIMITS.max_output_chars
    assert "[output truncated]" in result.report()
    assert time.monotonic() - started < LIMITS.wall_time_s  # killed at the cap, not at the wall-time limit
    assert sandbox_processes(since) == []


def test_infinite_loop_is_killed_with_its_children():
    since = time.time() - 1.0  # process start times are rounded to clock ticks
    token = secrets.token_hex(8)
    result = run_python(
        DISARM
        + f"""import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)  # {token}"], start_new_session=True)
while True:
    pass""",
        LIMITS,
    )
    assert result.timed_out, result.report()
    assert sandbox_processes(since) == []
    assert not [p for p in psutil.process_iter(["cmdline"]) if token in " ".join(p.info["cmdline"] or ())]


# --- network -----------------------------------------------------------------------------------------------


@pytest.fixture()
def loopback_server(tmp_path):
    """A TCP server on the host's loopback, a unix socket in tmp_path and an abstract one; counts connections."""
    tcp = socket.create_server(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(tmp_path / "host.sock"))
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(f"\0opentinker-test-{secrets.token_hex(4)}")
    accepted: list[str] = []
    for s in (tcp, unix, abstract):
        s.listen()
        s.settimeout(0.2)

    stop = threading.Event()

    def serve():
        while not stop.is_set():
            for s in (tcp, unix, abstract):
                try:
                    conn, _ = s.accept()
                    accepted.append(repr(s))
                    conn.close()
                except TimeoutError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield {
        "port": tcp.getsockname()[1],
        "unix": str(tmp_path / "host.sock"),
        "abstract": abstract.getsockname(),
        "accepted": accepted,
    }
    stop.set()
    thread.join()
    for s in (tcp, unix, abstract):
        s.close()


@pytest.mark.parametrize("guard", ["on", "disarmed"])
def test_network_and_host_sockets_are_unreachable(guard, loopback_server):
    srv = loopback_server
    out = invoke(
        f"""import socket
def tcp():
    return socket.create_connection(("127.0.0.1", {srv["port"]}), timeout=1)
def unix(path):
    s = socket.socket(socket.AF_UNIX); s.settimeout(1); s.connect(path); return s
attempt("tcp", tcp)
attempt("unix", lambda: unix({srv["unix"]!r}))
attempt("abstract", lambda: unix({srv["abstract"]!r}))
attempt("dbus", lambda: unix("/run/dbus/system_bus_socket"))
attempt("docker", lambda: unix("/var/run/docker.sock"))
attempt("internet", lambda: socket.create_connection(("1.1.1.1", 53), timeout=1))
attempt("dns", lambda: socket.getaddrinfo("example.com", 80))
""",
        guard,
    )
    assert out.count("refused:") == 7, out
    assert srv["accepted"] == []


# --- state between calls, identity, kernel attack surface ---------------------------------------------------


def test_no_state_carries_over_between_calls():
    first = invoke(
        "import os, sys\nopen('/tmp/state', 'w').write('kept')\nos.environ['LEFT'] = '1'\n"
        "sys.modules['os'].LEFT = 1\nprint('written')",
        "disarmed",
    )
    assert "written" in first
    second = invoke(
        "import os\nattempt('file', lambda: open('/tmp/state').read())\n"
        "print('env', os.environ.get('LEFT'), 'attr', getattr(os, 'LEFT', None))",
        "disarmed",
    )
    assert "file refused" in second and "env None attr None" in second


def test_identity_is_unprivileged():
    out = invoke(
        "import os, socket\nprint(os.getuid(), os.getgid(), socket.gethostname())\n"
        "print(open('/proc/self/status').read())\n"
        "print('setuid-capable mounts:', [l for l in open('/proc/self/mountinfo') if 'nosuid' not in l])\n"
        "attempt('tty', lambda: os.open('/dev/tty', os.O_RDWR))",
        "disarmed",
    )
    assert "setuid-capable mounts: []" in out and "tty refused:" in out, out  # no suid; no terminal to inject into
    assert out.startswith("65534 65534 sandbox"), out
    status = dict(line.split(":\t", 1) for line in out.splitlines() if ":\t" in line)
    assert status["CapEff"].strip() == "0000000000000000" and status["CapPrm"].strip() == "0000000000000000"
    assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2"


SYSCALLS = {  # name: (number on x86_64, arguments)
    "ptrace_attach": (101, (16, 1, 0, 0)),
    "mount": (165, (0, 0, 0, 0)),
    "unshare_user": (272, (0x10000000,)),
    "setns": (308, (0, 0)),
    "keyctl": (250, (0, 0)),
    "bpf": (321, (0, 0, 0)),
    "perf_event_open": (298, (0, 0, -1, -1, 0)),
    "userfaultfd": (323, (0,)),
    "io_uring_setup": (425, (1, 0)),
    "open_by_handle_at": (304, (0, 0, 0)),
    "chroot": (161, (0,)),
}


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="syscall numbers are x86_64's")
def test_kernel_attack_surface_is_filtered():
    calls = "".join(
        f"r = libc.syscall({nr}, *{args!r}); print({name!r}, r, ctypes.get_errno())\n"
        for name, (nr, args) in SYSCALLS.items()
    )
    out = invoke("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n" + calls, "disarmed")
    for name in SYSCALLS:
        assert f"{name} -1 1\n" in out + "\n", out  # -1 with EPERM: refused by seccomp before any check


# --- fail closed, and the explicit opt-out -----------------------------------------------------------------


def test_missing_bubblewrap_refuses_to_run_code(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        PythonREPL(limits=LIMITS).invoke({"code": "print(1)"})


def test_opt_out_runs_without_isolation_only_when_asked(monkeypatch):
    monkeypatch.setenv("OPENTINKER_SANDBOX", "none")
    get_settings.cache_clear()
    try:
        result = run_python("print(17 * 23)", LIMITS)
    finally:
        monkeypatch.delenv("OPENTINKER_SANDBOX")
        get_settings.cache_clear()
    assert result.ok and result.output.strip() == "391" and not result.network_isolated
    assert run_python("print(1)", LIMITS).network_isolated
