"""The kernel boundary both sandboxes share: bubblewrap (``bwrap``) and one seccomp filter.

``opentinker/llm/sandbox.py`` (model-written code) and ``opentinker/server/sandbox.py`` (a service job's processes)
lay out their own filesystems and namespaces; what they share lives here: finding bwrap, refusing to run when the
kernel cannot make a sandbox (fail closed), and the seccomp program that fails mount, ptrace, namespace, keyring,
bpf, perf, io_uring and kernel-module calls with EPERM.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Sequence
from functools import lru_cache


class SandboxUnavailable(RuntimeError):
    """The OS isolation cannot be set up here; no code was run."""


DENIED_SYSCALLS = (
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "open_by_handle_at",
    "name_to_handle_at",
    "personality",
    "syslog",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "acct",
    "swapon",
    "swapoff",
    "reboot",
    "quotactl",
    "lookup_dcookie",
)
"""System calls the seccomp filter fails with EPERM (everything else is allowed)."""


def bwrap_path() -> str:
    exe = shutil.which("bwrap")
    if exe is None:
        raise SandboxUnavailable(
            "bubblewrap (bwrap) is not installed, so untrusted code cannot be isolated: install "
            "the Debian package 'bubblewrap' (./install.sh does), or set OPENTINKER_SANDBOX=none "
            "to run code without OS isolation on a trusted machine"
        )
    return exe


_PROBED: set[tuple[str, ...]] = set()


def probe(args: Sequence[str]) -> None:
    """Start one sandbox of ``bwrap ARGS`` (a layout, ``--``, a command that exits 0), once per process and layout:
    fail closed, naming what is missing, when the kernel refuses."""
    key = tuple(args)
    if key in _PROBED:
        return
    seccomp = pipe_with(seccomp_program())
    try:
        done = subprocess.run(
            [bwrap_path(), "--seccomp", str(seccomp), *args],
            check=False,
            capture_output=True,
            text=True,
            pass_fds=(seccomp,),
            timeout=60,
            env={},
        )
    finally:
        os.close(seccomp)
    if done.returncode != 0:
        raise SandboxUnavailable(
            f"bubblewrap could not create the sandbox ({done.stderr.strip() or done.returncode}):"
            " user namespaces must be allowed (sysctl kernel.unprivileged_userns_clone=1, "
            "user.max_user_namespaces > 0); or set OPENTINKER_SANDBOX=none on a trusted machine"
        )
    _PROBED.add(key)


@lru_cache(maxsize=1)
def seccomp_program() -> bytes:
    """The compiled seccomp program (allow by default; ``DENIED_SYSCALLS`` fail with EPERM)."""
    try:
        import pyseccomp
    except (ImportError, OSError) as exc:
        raise SandboxUnavailable(
            f"libseccomp is not usable ({exc}): install the Debian package 'libseccomp2' (./install.sh does)"
        ) from exc
    rules = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    for name in DENIED_SYSCALLS:
        rules.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
    read, write = os.pipe()
    with open(write, "wb") as out:
        rules.export_bpf(out)
    with open(read, "rb") as bpf:
        return bpf.read()


def pipe_with(data: bytes) -> int:
    """A pipe's read end holding ``data`` (bwrap reads the seccomp program from an fd)."""
    read, write = os.pipe()
    os.write(write, data)
    os.close(write)
    return read
