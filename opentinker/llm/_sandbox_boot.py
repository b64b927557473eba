"""Sandbox child entry point (sandbox.py runs its source with ``python -I -S -c``; never imported).

argv: WORKDIR MEMORY_MB CPU_S MAX_PROCS MAX_FILE_MB SITE_DIR. Reads the user's code from stdin, applies limits,
installs the audit guard (a second layer inside the bubblewrap sandbox, not a boundary), then runs the code like
a REPL cell (a trailing expression is printed).
"""

import ast
import os
import resource
import sys
import traceback


def _limit(kind, value):
    resource.setrlimit(kind, (value, value))


def _apply_limits(memory_mb, cpu_s, max_procs, max_file_mb):
    _limit(resource.RLIMIT_AS, memory_mb * 1024 * 1024)
    _limit(resource.RLIMIT_CPU, cpu_s)
    _limit(resource.RLIMIT_FSIZE, max_file_mb * 1024 * 1024)
    _limit(resource.RLIMIT_NOFILE, 64)
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_NPROC, max_procs)  # binds a non-root caller; for root, sandbox.py adds a pids cgroup


def _install_guard(workdir):
    """Refuse sockets, new processes, ctypes, and file access outside ``workdir`` (Python's own files readable)."""
    readable_roots = tuple(
        {
            os.path.realpath(p) + os.sep
            for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, *[p for p in sys.path if p])
        }
    )
    writable_root = os.path.realpath(workdir) + os.sep
    blocked_prefixes = (
        "socket.",
        "subprocess.",
        "os.fork",
        "os.forkpty",
        "os.system",
        "os.exec",
        "os.spawn",
        "os.posix_spawn",
        "os.kill",
        "os.killpg",
        "pty.",
        "ctypes.call_function",
        "ctypes.dlsym",
        "ctypes.cdata",
        "_posixsubprocess.",
        "os.chroot",
        "os.setuid",
        "sys.addaudithook",
        "os.link",
        "os.symlink",
    )

    def guard(event, args):
        if event.startswith(blocked_prefixes):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int) or path is None:
                return
            real = os.path.realpath(os.fsdecode(path)) + os.sep
            if real.startswith(writable_root):
                return
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & (
                os.O_WRONLY | os.O_RDWR
            )
            if not writing and real.startswith(readable_roots):
                return
            raise PermissionError(f"sandbox: access outside the sandbox directory is not allowed: {os.fsdecode(path)}")
        if event in (
            "os.chdir",
            "os.listdir",
            "os.scandir",
            "os.remove",
            "os.rename",
            "os.rmdir",
            "os.mkdir",
            "shutil.rmtree",
            "os.chmod",
            "os.chown",
            "os.truncate",
            "os.utime",
        ):
            target = args[0] if args else "."
            if isinstance(target, int):
                return
            real = os.path.realpath(os.fsdecode(target if target is not None else ".")) + os.sep
            if real.startswith(writable_root):
                return
            if event in ("os.listdir", "os.scandir") and real.startswith(readable_roots):
                return  # the import system lists package folders
            raise PermissionError(
                f"sandbox: access outside the sandbox directory is not allowed: {os.fsdecode(target)}"
            )

    sys.addaudithook(guard)


def _run_cell(source):
    tree = ast.parse(source, "<sandbox>", "exec")
    tail = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        tail = ast.Expression(tree.body.pop().value)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile(tree, "<sandbox>", "exec"), namespace)
    if tail is not None:
        value = eval(compile(tail, "<sandbox>", "eval"), namespace)
        if value is not None:
            print(repr(value))


def main():
    workdir, memory_mb, cpu_s, max_procs, max_file_mb, site = sys.argv[1], *map(int, sys.argv[2:6]), sys.argv[6]
    source = sys.stdin.read()
    sys.stdin.close()
    os.chdir(workdir)
    _apply_limits(memory_mb, cpu_s, max_procs, max_file_mb)
    sys.path.append(site)
    _install_guard(workdir)
    try:
        _run_cell(source)
    except SystemExit:
        raise
    except BaseException as exc:  # report like a REPL would: the traceback, then a non-zero exit
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "<sandbox>":
            tb = tb.tb_next  # hide this bootstrap's own frames
        traceback.print_exception(type(exc), exc, tb)
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()


main()
