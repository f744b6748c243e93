"""What a contained step sees, and the bubblewrap command line that gives
it that in the ``linux_sandbox`` profile.

Both containing profiles show a step the same host:

- the data directory (every other step's logs, results and workspaces, the
  SQLite file, the broker folder) and ``EXECGO_SANDBOX_HIDDEN_PATHS`` (the
  host's sockets under /run, home directories) covered by an empty tmpfs;
- its own workspace, /tmp and /dev/shm as fresh tmpfs, the workspace and
  /tmp sized by the ``workspace_bytes`` limit (a quota that needs no cgroups:
  a write past it fails with ENOSPC);
- a network namespace of its own unless the plan says ``host``.

``linux_sandbox`` adds a read-only view of the rest of the host, a user
namespace, a new session (no TIOCSTI on the caller's terminal), no
capabilities, a cleared environment, death with the parent, no new user
namespaces (``--disable-userns``), no_new_privs (bubblewrap always sets it)
and, where the plan says ``seccomp``, the system call filter of
``runtime.syscall_filter``. The uid is
dropped by the shim *before* bubblewrap runs, so the kernel sees the step's
own uid (RLIMIT_NPROC counts against it and root-owned files stay out of
reach); ``--uid`` only keeps that id inside the user namespace.

The ``process`` profile gets the mounts from the shim itself (see
``shim_process.isolate``), in a mount namespace of the command's own.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Mapping
from typing import Any

from django.conf import settings

# Small and read-only: hidden paths hold nothing and take no writes.
HIDDEN_TMPFS_BYTES = 64 * 1024
SHM_BYTES = 64 * 1024 * 1024


def bwrap_path() -> str | None:
    return settings.EXECGO_BWRAP_PATH or shutil.which("bwrap")


def pasta_path() -> str | None:
    return settings.EXECGO_PASTA_PATH or shutil.which("pasta")


def pasta_argv(pasta: str, *, tcp_only: bool = False) -> list[str]:
    """The user-mode NAT in front of bubblewrap for ``"network": "internet"``
    (and of an http step's request, runtime/tools/http.py): pasta makes the
    network namespace (bubblewrap then shares it) with a copy of the host's
    address and routes, so the host's own address is the step's own; the
    gateway is not mapped to the host (``--no-map-gw``) and no port of the
    host's loopback is forwarded in (``-T none -U none``), nor of the step's
    out (``-t none -u none``). ``tcp_only``: no UDP or ICMP leaves the
    namespace (a request needs neither: it connects to a checked address)."""
    return [pasta, "--config-net", "--quiet", "--no-map-gw", "-t", "none", "-u", "none", "-T", "none", "-U", "none",
            *(["--no-udp", "--no-icmp"] if tcp_only else []), "--"]


def hidden_paths() -> list[str]:
    key = (str(settings.DATA_DIR), str(settings.EXECGO_TASKS_DIR), tuple(settings.EXECGO_SANDBOX_HIDDEN_PATHS))
    if key not in _hidden:
        _hidden[key] = _hidden_paths()
    return _hidden[key]


_hidden: dict[tuple, list[str]] = {}


def _hidden_paths() -> list[str]:
    """Host paths a contained step must not even read, parents first: the
    data directory holds the embedded database, the broker folder and every
    other step's files (other tenants' included); the rest are the host's
    sockets and services' state. Symlinks are followed (``/var/run`` is
    ``/run``) and paths this host does not have are skipped."""
    paths = {os.path.realpath(settings.DATA_DIR), os.path.realpath(settings.EXECGO_TASKS_DIR)}
    for path in settings.EXECGO_SANDBOX_HIDDEN_PATHS:
        real = os.path.realpath(path)
        try:
            mode = os.stat(real).st_mode
        except OSError:
            continue
        if stat.S_ISDIR(mode) and mode & 0o005:  # others may look in: hide it (each mount costs a step time)
            paths.add(real)
    # A path under another hidden one is already hidden.
    ordered = sorted(paths)
    return [p for p in ordered if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in ordered)]


def mount_plan(*, workspace: str, cwd: str, limits: Mapping[str, Any], writable_root: bool = False
               ) -> list[dict[str, Any]]:
    """The mounts of a contained step, in order, for either profile: each
    ``{"path", "kind": "hidden" | "scratch" | "workspace", "bytes"}``.
    ``writable_root``: the host's root is not read-only for the step (the
    process profile), so its world-writable /var/tmp gets a tmpfs of its own
    too (else steps could leave files there for each other)."""
    quota = limits.get("workspace_bytes")
    scratch = ("/tmp", "/dev/shm", *(("/var/tmp",) if writable_root else ()))
    # A path under a scratch directory is hidden by its fresh tmpfs already
    # (a data directory under /tmp, say).
    mounts: list[dict[str, Any]] = [
        {"path": p, "kind": "hidden", "bytes": HIDDEN_TMPFS_BYTES}
        for p in hidden_paths() if not any(p == s or p.startswith(s + "/") for s in scratch)
    ]
    mounts += [
        {"path": "/tmp", "kind": "scratch", "bytes": quota},
        {"path": "/dev/shm", "kind": "scratch", "bytes": min(quota or SHM_BYTES, SHM_BYTES)},
        *([{"path": "/var/tmp", "kind": "scratch", "bytes": quota}] if writable_root else []),
        {"path": workspace, "kind": "workspace", "bytes": quota, "cwd": cwd},
    ]
    return mounts


def bwrap_argv(
    *,
    bwrap: str,
    workspace: str,
    cwd: str,
    env: Mapping[str, str],
    uid: int | None,
    gid: int | None,
    limits: Mapping[str, Any] | None = None,
    network: str = "none",
    seccomp_fd: int | None = None,
) -> list[str]:
    """``seccomp_fd``: the descriptor bubblewrap reads the filter of
    ``runtime.syscall_filter`` from (a step's shim opens it as
    ``SECCOMP_FD``); bubblewrap loads it last, just before the command."""
    argv = [
        bwrap,
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--proc", "/proc",
    ]  # fmt: skip
    for mount in mount_plan(workspace=workspace, cwd=cwd, limits=limits or {}):
        if mount["kind"] == "hidden":
            # An empty tmpfs of the sandbox's own, a few pages at most: not
            # remounted read-only (a mount operation more per hidden path and
            # step), as nothing written there leaves the sandbox.
            argv += ["--perms", "0555", "--size", str(mount["bytes"]), "--tmpfs", mount["path"]]
            continue
        perms = "1777" if mount["kind"] == "scratch" else "0700"
        argv += ["--perms", perms]
        if mount["bytes"]:
            argv += ["--size", str(mount["bytes"])]
        argv += ["--tmpfs", mount["path"]]
        if mount["kind"] == "workspace" and mount["cwd"] != mount["path"]:
            argv += ["--dir", mount["cwd"]]
    argv += [
        "--chdir", cwd,
        "--unshare-all",
        # A user namespace for sure (--unshare-all only tries), so that
        # --disable-userns can keep the step from making more of them.
        "--unshare-user",
        "--disable-userns",
        # "internet": the namespace pasta made in front of us (see pasta_argv).
        *(["--share-net"] if network in ("host", "internet") else []),
        "--new-session",
        "--die-with-parent",
        "--cap-drop", "ALL",
        "--clearenv",
    ]  # fmt: skip
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    for name, value in env.items():
        argv += ["--setenv", name, value]
    if uid is not None:
        argv += ["--uid", str(uid), "--gid", str(gid if gid is not None else uid)]
    argv.append("--")
    return argv
