"""The command lines that contain a step in the ``linux_sandbox`` profile:
bubblewrap's, which builds the view of runtime/sandbox.py, and pasta's, the
user-mode NAT in front of it for ``"network": "internet"``.

``linux_sandbox`` builds that view on an empty root (read-only once built,
so nothing written outside the sized tmpfs stays in memory), with /proc of
its own PID namespace and a minimal /dev, and adds a user namespace, a new
session (no TIOCSTI on the caller's terminal), no capabilities, a cleared
environment, death with the parent, no new user namespaces
(``--disable-userns``), no_new_privs (bubblewrap always sets it) and, where
the plan says ``seccomp``, the system call filter of
``runtime.syscall_filter``. The uid is dropped by the shim *before*
bubblewrap runs, so the kernel sees the step's own uid (RLIMIT_NPROC counts
against it and root-owned files stay out of reach); ``--uid`` only keeps
that id inside the user namespace.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping
from typing import Any

from django.conf import settings

from runtime.sandbox import mount_plan, system_view


def bwrap_path() -> str | None:
    return settings.EXECGO_BWRAP_PATH or shutil.which("bwrap")


def pasta_path() -> str | None:
    return settings.EXECGO_PASTA_PATH or shutil.which("pasta")


def pasta_argv(pasta: str, *, tcp_only: bool = False) -> list[str]:
    """The user-mode NAT in front of bubblewrap for ``"network": "internet"``
    (and of an http step's request, runtime/tools/http_process.py): pasta
    makes the network namespace (bubblewrap then shares it) with a copy of
    the host's address and routes, so the host's own address is the step's
    own; the gateway is not mapped to the host (``--no-map-gw``) and no port
    of the host's loopback is forwarded in (``-T none -U none``), nor of the
    step's out (``-t none -u none``). ``tcp_only``: no UDP or ICMP leaves the
    namespace (a request needs neither: it connects to a checked address)."""
    return [pasta, "--config-net", "--quiet", "--no-map-gw", "-t", "none", "-u", "none", "-T", "none", "-U", "none",
            *(["--no-udp", "--no-icmp"] if tcp_only else []), "--"]


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
    readonly_paths: Iterable[str] = (),
    identity: Mapping[str, str] | None = None,
    seccomp_fd: int | None = None,
) -> list[str]:
    """bubblewrap's command line for a step, up to the ``--`` before the
    command: the system view, the step's mount plan, then the namespaces and
    the rest (see the module docstring). ``seccomp_fd``: the descriptor
    bubblewrap reads the filter of ``runtime.syscall_filter`` from (a step's
    shim opens it as ``SECCOMP_FD``); bubblewrap loads it last, just before
    the command."""
    argv = [bwrap]
    for entry in system_view():
        if entry["kind"] == "symlink":
            argv += ["--symlink", entry["target"], entry["path"]]
        else:
            argv += ["--ro-bind", entry["path"], entry["path"]]
    argv += ["--dev", "/dev", "--proc", "/proc"]
    for mount in mount_plan(workspace=workspace, cwd=cwd, limits=limits or {}, readonly_paths=readonly_paths,
                            identity=identity, uid=uid):
        argv += _mount_args(mount)
    argv += [
        # The empty root holding it all (and the directories bubblewrap made
        # there) is an unsized tmpfs the step's uid owns: read-only, so that
        # only the sized tmpfs take writes.
        "--remount-ro", "/",
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


def _mount_args(mount: Mapping[str, Any]) -> list[str]:
    """bubblewrap's options for one entry of the mount plan."""
    kind = mount["kind"]
    if kind == "readonly":
        return ["--ro-bind", mount.get("source", mount["path"]), mount["path"]]
    if kind == "hidden_file":
        return ["--ro-bind", mount["source"], mount["path"]]
    if kind == "hidden":
        # An empty tmpfs of the sandbox's own, a few pages at most: not
        # remounted read-only (a mount operation more per hidden path and
        # step), as nothing written there leaves the sandbox.
        return ["--perms", "0555", "--size", str(mount["bytes"]), "--tmpfs", mount["path"]]
    perms = "1777" if kind == "scratch" else "0700"
    args = ["--perms", perms]
    if mount["bytes"]:
        args += ["--size", str(mount["bytes"])]
    args += ["--tmpfs", mount["path"]]
    if kind == "workspace" and mount["cwd"] != mount["path"]:
        args += ["--dir", mount["cwd"]]
    return args
