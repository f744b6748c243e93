"""The ``linux_sandbox`` profile: the bubblewrap command line that wraps a step.

Read-only view of the host, a private /tmp, the data directory hidden
under an empty tmpfs, the step's workspace bound read-write at the same
path, every namespace unshared (so no network, not even the host's
loopback), a new session (no TIOCSTI on the caller's
terminal), no capabilities, a cleared environment, and death with the
parent. The uid is dropped by the shim *before* bubblewrap runs, so the
kernel sees the sandbox uid (RLIMIT_NPROC counts against it and root-owned
files stay out of reach); ``--uid`` only keeps that id inside the sandbox's
user namespace.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping

from django.conf import settings


def bwrap_path() -> str | None:
    return settings.EXECGO_BWRAP_PATH or shutil.which("bwrap")


def hidden_paths() -> list[str]:
    """Host paths a sandboxed step must not even read: the data directory
    holds the embedded database and every other step's files (other
    tenants' included), so it is covered by an empty tmpfs before the
    step's own workspace is bound back in."""
    paths = {str(settings.DATA_DIR), str(settings.EXECGO_TASKS_DIR)}
    return sorted(paths)  # a parent before its children


def bwrap_argv(
    *,
    bwrap: str,
    workspace: str,
    cwd: str,
    env: Mapping[str, str],
    uid: int | None,
    gid: int | None,
) -> list[str]:
    argv = [
        bwrap,
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--proc", "/proc",
        "--tmpfs", "/tmp",
        *[arg for path in hidden_paths() for arg in ("--tmpfs", path)],
        "--bind", workspace, workspace,
        "--chdir", cwd,
        "--unshare-all",
        "--new-session",
        "--die-with-parent",
        "--cap-drop", "ALL",
        "--clearenv",
    ]  # fmt: skip
    for name, value in env.items():
        argv += ["--setenv", name, value]
    if uid is not None:
        argv += ["--uid", str(uid), "--gid", str(gid if gid is not None else uid)]
    argv.append("--")
    return argv
