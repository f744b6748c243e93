"""The seccomp filter of the ``linux_sandbox`` profile: the system calls no
agent step needs, refused with EPERM (never a kill: a program that probes
for a feature sees "not permitted" and goes on without it).

The list lives here and only here (README's "Sandbox" section describes it).
It follows Docker's and podman's default profiles and nsjail's, less what
those only allow with capabilities a step never has:

- mounts and the root: ``mount``, ``umount``/``umount2``, the new mount API
  (``fsopen``, ``fsconfig``, ``fsmount``, ``fspick``, ``move_mount``,
  ``open_tree``, ``mount_setattr``), ``pivot_root``, ``chroot``;
- namespaces: ``unshare``, ``setns``, and ``clone`` with any CLONE_NEW* flag
  (bubblewrap's ``--disable-userns`` also stops new user namespaces);
  ``clone3`` passes its flags in memory a filter cannot read, so it gets
  ENOSYS, on which the C library falls back to ``clone`` (as under Docker);
- the kernel itself: ``kexec_load``, ``kexec_file_load``, ``init_module``,
  ``finit_module``, ``delete_module`` (and the obsolete ``create_module``,
  ``get_kernel_syms``, ``query_module``), ``bpf``, ``perf_event_open``,
  ``userfaultfd``, ``io_uring_setup``/``_enter``/``_register`` (a large
  attack surface, off in Docker since 2023), ``reboot``, ``swapon``,
  ``swapoff``, ``acct``, ``quotactl``/``quotactl_fd``, ``syslog``,
  ``lookup_dcookie``, ``fanotify_init``, ``nfsservctl``, ``uselib``,
  ``ustat``, ``sysfs``, ``_sysctl``, ``vhangup``;
- the kernel keyring: ``keyctl``, ``add_key``, ``request_key``;
- other processes: ``ptrace``, ``process_vm_readv``, ``process_vm_writev``,
  ``process_madvise``, ``pidfd_getfd``, ``kcmp``;
- file handles that bypass path checks: ``open_by_handle_at``,
  ``name_to_handle_at``;
- the clock: ``settimeofday``, ``stime``, ``clock_settime``,
  ``clock_adjtime``, ``adjtimex``;
- hardware: ``iopl``, ``ioperm``, ``vm86``, ``vm86old``;
- ``personality`` with anything but the default (0) or the query
  (0xffffffff): no disabling of address space randomisation, no
  READ_IMPLIES_EXEC.

Architectures: on x86_64 the filter also covers the i386 (``int 0x80``) and
x32 ABIs with the same rules, so a step cannot reach a refused call through
the other system call table; a call from any other ABI kills the process
(libseccomp's default for a foreign architecture).

The filter is compiled once per process with libseccomp (PyPI's
``pyseccomp``, ctypes over Debian's libseccomp2) into a BPF program under
the tasks directory, named by its digest; each step's shim opens that file
and hands it to bubblewrap as ``--seccomp FD`` (see
``shim_exec.exec_command``), which loads it last, just before it runs
the command.
"""

from __future__ import annotations

import errno
import hashlib
import os
import platform
import tempfile
import threading
from pathlib import Path

from django.conf import settings

from runtime.shim_exec import SECCOMP_FD

__all__ = ["SECCOMP_FD", "DENIED_SYSCALLS", "FilterUnavailable", "compile_program", "program_path"]

DENIED_SYSCALLS = (
    # mounts and the root
    "mount", "umount", "umount2", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree",
    "mount_setattr", "pivot_root", "chroot",
    # namespaces (clone: see NAMESPACE_FLAGS)
    "unshare", "setns",
    # the kernel itself
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "create_module",
    "get_kernel_syms", "query_module", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd",
    "syslog", "lookup_dcookie", "fanotify_init", "nfsservctl", "uselib", "ustat", "sysfs", "_sysctl", "vhangup",
    # the kernel keyring
    "keyctl", "add_key", "request_key",
    # other processes
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd", "kcmp",
    # file handles
    "open_by_handle_at", "name_to_handle_at",
    # the clock
    "settimeofday", "stime", "clock_settime", "clock_adjtime", "adjtimex",
    # hardware
    "iopl", "ioperm", "vm86", "vm86old",
)  # fmt: skip
# clone() flags that make a namespace (CLONE_NEWTIME is 0x80, which clone()
# reads as part of the exit signal: only clone3/unshare take it).
NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}  # fmt: skip
# personality(2) values a step may pass: the default persona and the query.
PERSONALITY_ALLOWED = (0x0, 0xFFFFFFFF)
ENOSYS_SYSCALLS = ("clone3",)

_lock = threading.Lock()
_compiled: dict[str, str] = {}  # tasks dir -> path of the program
_error: dict[str, str] = {}


class FilterUnavailable(Exception):
    """libseccomp is missing or cannot build the filter on this host."""


def _extra_arches(seccomp) -> list[int]:
    """The ABIs besides the native one that this kernel may run a step's
    code in (x86_64: i386 and x32)."""
    if platform.machine() == "x86_64":
        return [seccomp.Arch.X86, seccomp.Arch.X32]
    if platform.machine() == "aarch64":
        return [seccomp.Arch.ARM]
    return []


def _build(seccomp):
    """The libseccomp filter: allow by default, refuse the list above."""
    deny = seccomp.ERRNO(errno.EPERM)
    flt = seccomp.SyscallFilter(seccomp.ALLOW)
    for arch in _extra_arches(seccomp):
        flt.add_arch(arch)

    def rule(action, name, *args):
        try:
            number = seccomp.resolve_syscall(seccomp.Arch.NATIVE, name)
        except OSError:
            return  # a name libseccomp does not know: no ABI of this host has it
        flt.add_rule(action, number, *args)

    for name in DENIED_SYSCALLS:
        rule(deny, name)
    for name in ENOSYS_SYSCALLS:
        rule(seccomp.ERRNO(errno.ENOSYS), name)
    for flag in NAMESPACE_FLAGS.values():
        rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    # libseccomp takes one comparison per argument and rule: "neither 0 nor
    # all ones" is "some bit set whose next bit (cyclically) is clear", one
    # rule per bit of the 32-bit persona.
    assert PERSONALITY_ALLOWED == (0x0, 0xFFFFFFFF)
    for bit in range(32):
        mask = (1 << bit) | (1 << ((bit + 1) % 32))
        rule(deny, "personality", seccomp.Arg(0, seccomp.MASKED_EQ, mask, 1 << bit))
    return flt


def compile_program() -> bytes:
    """The filter as a BPF program, the form ``bwrap --seccomp`` reads."""
    try:
        import pyseccomp as seccomp
    except (ImportError, RuntimeError) as exc:  # RuntimeError: the binding found no libseccomp
        raise FilterUnavailable(f"libseccomp is not usable: {exc}") from exc
    try:
        flt = _build(seccomp)
        with tempfile.TemporaryFile() as out:
            flt.export_bpf(out)
            out.seek(0)
            return out.read()
    except OSError as exc:
        raise FilterUnavailable(f"libseccomp cannot build the filter: {exc}") from exc


def program_path() -> str:
    """The compiled filter's file under the tasks directory (compiled once
    per process; written again if it went missing). Its name is its digest,
    so a changed list never reuses an old program; it is the worker's alone
    (0600): the shim opens it before it drops to the step's uid."""
    key = str(settings.EXECGO_TASKS_DIR)
    with _lock:
        path = _compiled.get(key)
        if path is not None and os.path.exists(path):
            return path
        if key in _error:
            raise FilterUnavailable(_error[key])
        try:
            program = compile_program()
        except FilterUnavailable as exc:
            _error[key] = str(exc)
            raise
        directory = Path(key)
        directory.mkdir(parents=True, exist_ok=True)
        path = str(directory / f"seccomp-{hashlib.sha256(program).hexdigest()[:16]}.bpf")
        if not _same_bytes(path, program):
            tmp = f"{path}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, program)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        _compiled[key] = path
        return path


def _same_bytes(path: str, program: bytes) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read() == program
    except OSError:
        return False
