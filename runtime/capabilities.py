"""Capability probe: what this host can actually enforce.

Run once per process (at worker start, or lazily on first use) and cached.
Nothing is assumed from the distribution or the kernel version: each
mechanism the shim relies on is exercised for real (a PID namespace is
created, an RLIMIT_FSIZE overrun is provoked, bubblewrap runs ``true`` with
the exact options and uid the ``linux_sandbox`` profile uses).
The manifest is plain JSON, shown by the dashboard and /readyz and stored
on the host's ledger row.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from datetime import UTC, datetime
from typing import Any

import psutil
from django.conf import settings

from runtime import syscall_filter
from runtime.layout import shim_command
from runtime.sandbox_argv import bwrap_argv, bwrap_path, pasta_argv, pasta_path

_lock = threading.Lock()
_cached: str | None = None  # the manifest as JSON: each caller gets its own copy, cheaper parsed than deep-copied
PROBE_TIMEOUT_S = 10


def host_name() -> str:
    return settings.EXECGO_HOST_NAME or socket.gethostname()


def sandbox_uid() -> int | None:
    """The uid untrusted commands drop to when the worker runs as root (None: never drop)."""
    return settings.EXECGO_SANDBOX_UID


def capability_manifest(*, refresh: bool = False) -> dict[str, Any]:
    """The host's manifest (probed once per process): a copy, the caller's to change."""
    global _cached
    with _lock:
        if _cached is None or refresh:
            _cached = json.dumps(probe_host())
        return json.loads(_cached)


def probe_host() -> dict[str, Any]:
    is_root = os.geteuid() == 0
    drop_uid = sandbox_uid() if is_root else None
    shim = _shim_self_test()
    bubblewrap = _probe_bubblewrap(drop_uid)
    memory = psutil.virtual_memory()
    uname = os.uname()
    return {
        "version": 1,
        "probed_at": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "host": {"name": host_name(), "kernel": uname.release, "arch": uname.machine, "python": sys.version.split()[0]},
        "user": {"euid": os.geteuid(), "is_root": is_root, "sandbox_uid": drop_uid},
        "cpu": {"logical": psutil.cpu_count() or 1, "physical": psutil.cpu_count(logical=False)},
        "memory": {"total_bytes": memory.total, "available_bytes": memory.available},
        "cgroup": _probe_cgroups(),
        "user_namespaces": _probe_user_namespaces(drop_uid),
        "pid_namespace": shim.get("pid_namespace", {"available": False, "error": shim.get("error")}),
        "rlimits": {
            **shim.get("rlimits", {"enforced": False, "error": shim.get("error")}),
            # The kernel skips the RLIMIT_NPROC check for uid 0 (also for root
            # inside a user namespace), so it only bites after a uid drop.
            "nproc_enforced": (not is_root) or drop_uid is not None,
        },
        "bubblewrap": bubblewrap,
        "seccomp": _probe_seccomp(bubblewrap, drop_uid),
        # The process profile's own mount and network namespaces (root only).
        "namespaces": shim.get("namespaces", {"mount": False, "net": False}),
        "pasta": _probe_pasta(drop_uid),
    }


def _shim_self_test() -> dict[str, Any]:
    try:
        proc = subprocess.run(
            shim_command("--probe"), capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False
        )
        return json.loads(proc.stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        return {"error": f"shim self-test failed: {exc}"}


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def _probe_cgroups() -> dict[str, Any]:
    v2_mount, v1_controllers = None, []
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        before, _, after = line.partition(" - ")
        fstype, _source, options = (after.split() + ["", "", ""])[:3]
        mount_point = before.split()[4]
        if fstype == "cgroup2" and v2_mount is None:
            v2_mount = mount_point
        elif fstype == "cgroup":
            v1_controllers += [o for o in options.split(",") if o not in ("rw", "ro") and not o.startswith("name=")]
    result: dict[str, Any] = {
        "v2_mounted": v2_mount is not None,
        "v2_mount": v2_mount,
        "v1_controllers": sorted(set(v1_controllers)),
    }
    if v2_mount:
        own = next(
            (ln[3:] for ln in (_read("/proc/self/cgroup") or "").splitlines() if ln.startswith("0::")),
            "/",
        )
        group_dir = os.path.join(v2_mount, own.lstrip("/"))
        available = (_read(os.path.join(group_dir, "cgroup.controllers")) or "").split()
        result.update(
            {
                "v2_group": own,
                "v2_controllers": available,
                "v2_subtree_control": (_read(os.path.join(group_dir, "cgroup.subtree_control")) or "").split(),
                "v2_writable": os.access(group_dir, os.W_OK),
            }
        )
        result["delegated"] = sorted(c for c in available if result["v2_writable"])
    else:
        result["delegated"] = []
    result["memory_controller"] = "memory" in result["delegated"]
    result["pids_controller"] = "pids" in result["delegated"]
    return result


def _run_probe(argv: list[str], uid: int | None, *, pass_fds: tuple[int, ...] = ()) -> tuple[bool, str]:
    kwargs: dict[str, Any] = {}
    if uid is not None:
        kwargs = {"user": uid, "group": uid, "extra_groups": []}
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False, cwd="/", pass_fds=pass_fds,
            **kwargs,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return False, str(exc)
    return proc.returncode == 0, (proc.stderr or proc.stdout).strip()[-500:]


def _probe_user_namespaces(drop_uid: int | None) -> dict[str, Any]:
    max_namespaces = _read("/proc/sys/user/max_user_namespaces")
    unshare = "/usr/bin/unshare" if os.path.exists("/usr/bin/unshare") else None
    result: dict[str, Any] = {"max_user_namespaces": int(max_namespaces) if max_namespaces else None}
    if unshare is None:
        result.update({"unprivileged": None, "error": "unshare(1) not installed"})
        return result
    # The uid that will create namespaces: the sandbox uid after a drop, or ourselves.
    ok, error = _run_probe([unshare, "--user", "true"], drop_uid)
    result.update({"unprivileged": ok, "tested_as_uid": drop_uid if drop_uid is not None else os.geteuid()})
    if not ok:
        result["error"] = error
    return result


def _probe_pasta(drop_uid: int | None) -> dict[str, Any]:
    """The user-mode NAT of ``"network": "internet"`` (see sandbox_argv.pasta_argv),
    run for real as the sandbox uid."""
    path = pasta_path()
    if not path:
        return {"available": False, "path": None, "error": "pasta (passt) not installed"}
    works, error = _run_probe([*pasta_argv(path), "true"], drop_uid)
    result: dict[str, Any] = {"available": works, "path": path}
    if not works:
        result["error"] = error
    return result


# Run under the filter: its own status must read mode 2 (filter), and a
# refused call (unshare of a user namespace) must fail with EPERM.
SECCOMP_CHECK = ('grep -q "^Seccomp:[[:space:]]*2$" /proc/self/status && '
                 '! unshare --user true 2>/dev/null')


def _probe_seccomp(bubblewrap: dict[str, Any], drop_uid: int | None) -> dict[str, Any]:
    """Can bubblewrap load the filter of ``runtime.syscall_filter`` here?
    Compiled (libseccomp) and run for real, as the sandbox uid, in the very
    sandbox a step gets."""
    try:
        program = syscall_filter.program_path()
    except syscall_filter.FilterUnavailable as exc:
        return {"available": False, "error": str(exc)}
    result: dict[str, Any] = {"program": os.path.basename(program), "denied": len(syscall_filter.DENIED_SYSCALLS)}
    if not bubblewrap.get("available"):
        return {**result, "available": False, "error": "bubblewrap is unusable, and with it --seccomp"}
    fd = os.open(program, os.O_RDONLY)
    try:
        works, error = _run_sandbox_probe(["/bin/sh", "-c", SECCOMP_CHECK], drop_uid, seccomp_fd=fd)
    finally:
        os.close(fd)
    result["available"] = works
    if not works:
        result["error"] = error or "the filter did not apply"
    return result


def _run_sandbox_probe(command: list[str], drop_uid: int | None, *, seccomp_fd: int | None = None
                       ) -> tuple[bool, str]:
    """``command`` in the sandbox a default step gets (a scratch workspace)."""
    path = bwrap_path()
    workspace = tempfile.mkdtemp(prefix="execgo-probe-")
    try:
        os.chmod(workspace, 0o755)
        if drop_uid is not None:
            os.chown(workspace, drop_uid, drop_uid)
        argv = bwrap_argv(
            bwrap=path, workspace=workspace, cwd=workspace, env={"PATH": "/usr/bin:/bin"}, uid=drop_uid, gid=drop_uid,
            limits={"workspace_bytes": 1024 * 1024}, seccomp_fd=seccomp_fd,
        )
        return _run_probe([*argv, *command], drop_uid, pass_fds=() if seccomp_fd is None else (seccomp_fd,))
    finally:
        os.rmdir(workspace)


def _probe_bubblewrap(drop_uid: int | None) -> dict[str, Any]:
    path = bwrap_path()
    if not path:
        return {"available": False, "path": None, "error": "bwrap not installed"}
    ok_version, version = _run_probe([path, "--version"], None)
    works, error = _run_sandbox_probe(["true"], drop_uid)
    result = {
        "available": works,
        "path": path,
        "version": version.split()[-1] if ok_version and version else None,
        "tested_as_uid": drop_uid if drop_uid is not None else os.geteuid(),
    }
    if not works:
        result["error"] = error
    return result
