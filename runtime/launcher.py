"""Prepare a step's task directory and start its shim, detached from the
worker.

Shell steps run in a shim (see runtime/shim.py) that is started without
``preexec_fn`` (from the fork server, or by ``posix_spawn`` in a new
session) and never is a child the worker must keep alive: if the worker is
SIGKILLed the shim finishes, writes result.json, and a restarted worker
re-attaches (see runtime/attach.py).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings

from runtime import forkserver, shim, shim_exec, shim_prestart
from runtime.envelopes import EnvelopeError
from runtime.layout import (
    LAUNCH_FILE,
    WORKSPACE_DIR,
    load_json,
    secure_tasks_dir,
    shim_command,
    shim_python,
    task_dir,
    tasks_dir,
    write_json_atomic,
    write_private,
)
from runtime.plan_resolver import resolve_plan
from runtime.sandbox import IDENTITY_FILES, mount_plan, visible_roots
from runtime.tools import shell as shell_tool
from runtime.tools import validate_params

logger = logging.getLogger(__name__)

SHIM_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}

# Shims started by posix_spawn are our children until reaped.
_spawned: set[int] = set()


@dataclass(frozen=True)
class ShimHandle:
    handle_id: str
    pid: int
    create_time: float | None  # seconds after boot (clock ticks), never the wall clock
    via: str  # "forkserver" | "spare" (forked by the server ahead of its step) | "spawn"
    # The fork server's shims report "done" on it (see forkserver.ShimLink).
    link: forkserver.ShimLink | None = field(default=None, compare=False)


def prepare(handle_id: str, *, tool: str, params: dict, timeout_s: float, attempt: int, plan: dict) -> Path:
    """Write tasks/<handle_id>/request.json and create workspace/.

    ``plan`` is the effective plan from ``resolve_plan``; a bare requested
    sandbox (``{"profile", "limits"}``) is resolved here, adaptively.
    """
    return prepare_request(handle_id, tool=tool, params=params, timeout_s=timeout_s, attempt=attempt, plan=plan)[0]


def prepare_request(handle_id: str, *, tool: str, params: dict, timeout_s: float, attempt: int, plan: dict
                    ) -> tuple[Path, dict[str, Any]]:
    """``prepare`` -> the task directory and the request written there."""
    validate_params(tool, params)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s < 7 * 86400:
        raise EnvelopeError.of("invalid_input", "timeout_s must be a positive number of seconds")
    plan = dict(plan or {})
    if not {"profile", "limits", "tree_kill"} <= plan.keys():
        plan = resolve_plan({key: plan[key] for key in ("profile", "limits") if key in plan})
    directory = task_dir(handle_id)
    if _fenced() and any((directory / name).exists() for name in (LAUNCH_FILE, shim.SHIM_FILE, shim.RESULT_FILE)):
        raise EnvelopeError.of(
            "invalid_input", f"handle {handle_id} was already launched", details={"handle_id": handle_id}
        )
    workspace = directory / WORKSPACE_DIR
    contained = plan.get("filesystem") == "workspace"
    owner = plan.get("uid")
    group = plan.get("gid") if plan.get("gid") is not None else owner
    # Only the worker (and the shim, as root) may enter the task directory's
    # files; a contained step gets a fresh tmpfs mounted over workspace/,
    # so the directory on disk stays the worker's.
    secure_tasks_dir()
    directory.mkdir(mode=0o711, exist_ok=True)
    workspace.mkdir(mode=0o700, exist_ok=True)
    chown = owner is not None and os.geteuid() == 0 and not contained
    if chown:
        os.chown(workspace, owner, group)
    request: dict[str, Any] = {
        "version": 1,
        "handle_id": handle_id,
        "tool": tool,
        "params": params,
        "attempt": attempt,
        "timeout_s": float(timeout_s),
        "plan": plan,
        "prepared_at": time.time(),
        "workspace": str(workspace),
    }
    if tool == "shell":
        command = _shell_request(handle_id, params, plan)
        Path(command["cwd"]).mkdir(parents=True, exist_ok=True)
        if chown:
            for path in Path(command["cwd"]).relative_to(workspace).parents:
                os.chown(workspace / path, owner, group)
            os.chown(command["cwd"], owner, group)
        if command["stdin"]:
            write_private(directory / shim.STDIN_FILE, params["stdin"].encode())
        request.update(command)
    write_json_atomic(directory / shim.REQUEST_FILE, request)
    return directory, request


def _shell_request(handle_id: str, params: dict, plan: dict) -> dict[str, Any]:
    """The shell part of a request: what the shim starts, and how."""
    command = shell_tool.build_request(params, handle_id=handle_id, workspace=task_dir(handle_id) / WORKSPACE_DIR,
                                       plan=plan)
    command.update(
        {
            "limits": plan["limits"],
            "uid": plan.get("uid"),
            "gid": plan.get("gid"),
            "tree_kill": plan["tree_kill"],
            "kill_grace_s": settings.EXECGO_KILL_GRACE_S,
            "drain_grace_s": settings.EXECGO_DRAIN_GRACE_S,
        }
    )
    return command


def sandbox_preset(handle_id: str, *, tool: str, params: dict, plan: dict) -> str | None:
    """For a step that will most likely be prepared as ``handle_id`` with
    ``plan``: the exec fields its request will have, as the preset of a
    spare that pre-starts its sandbox (see ``shim_prestart.Prestart``) -> JSON, or
    None when it starts the usual way: no bubblewrap sandbox in a PID
    namespace of its own, stdin (its file comes with the request), outbound
    network (pasta starts in front of bubblewrap), or what the gate would
    not start as bubblewrap does (``_gate_keeps``)."""
    if tool != "shell" or plan.get("profile") != "linux_sandbox" or plan.get("tree_kill") != "pid_namespace":
        return None
    try:
        validate_params(tool, params)
        # The step's /etc/passwd is written there now (the preset's mounts
        # name it), as prepare will write it again.
        secure_tasks_dir()
        task_dir(handle_id).mkdir(mode=0o711, exist_ok=True)
        command = _shell_request(handle_id, params, plan)
    except (EnvelopeError, KeyError):
        return None
    if command["stdin"] or command["own_proc"] or command["isolation"] or not command["sandbox_argv"]:
        return None
    if not _gate_keeps(command, handle_id, plan):
        return None
    return json.dumps({name: command.get(name) for name in shim_prestart.PRESET_FIELDS})


def discard_preset(handle_id: str) -> None:
    """Remove the task directory ``sandbox_preset`` made for ``handle_id``
    once its spare is closed unused and no step will ever be prepared as
    that handle (it was never recorded: a handle's suffix is random, so no
    later attempt takes it). Only while it holds nothing but the step's
    identity files: a directory a step was prepared in is never touched. A
    sandbox of the closed spare still binding them (in its own mount
    namespace) does not keep them from going."""
    try:
        directory = task_dir(handle_id)
        names = os.listdir(directory)
    except (EnvelopeError, OSError):
        return
    if not set(names) <= set(IDENTITY_FILES.values()):
        return
    try:
        for name in names:
            os.unlink(directory / name)
        os.rmdir(directory)
    except OSError:
        pass  # written to meanwhile: what is there stays


# Variables the gate's shell sets or reads itself (dash): a step naming one
# starts without a pre-started sandbox.
SHELL_VARIABLES = frozenset({"PWD", "OLDPWD", "PPID", "IFS", "OPTIND", "OPTARG", "LINENO", "ENV", "PS1", "PS2",
                             "PS4", "MAIL", "MAILPATH", "MAILCHECK", "HISTSIZE"})


def _gate_keeps(command: dict[str, Any], handle_id: str, plan: dict) -> bool:
    """Whether the pre-started sandbox's gate (``shim_prestart.GATE_ARGV``) execs the
    command as bubblewrap itself would. Its shell passes every variable on
    but its own (in another order), and it would report an exec failure in
    its own words: so the program must be one the step's uid can run, found
    in what the sandbox shows of the host (its system directories and
    read-only paths, not in a tmpfs or hidden path)."""
    env = command["env"]
    if SHELL_VARIABLES & env.keys() or not os.access(shim_prestart.GATE_ARGV[0], os.X_OK):
        return False
    readonly = plan.get("readonly_paths") or ()
    masked = [mount["path"] for mount in mount_plan(workspace=str(task_dir(handle_id) / WORKSPACE_DIR),
                                                    cwd=command["cwd"], limits=plan.get("limits") or {},
                                                    readonly_paths=readonly, uid=plan.get("uid"))
              if mount["kind"] != "readonly"]
    program = _program(command["argv"][0], env.get("PATH"))
    return program is not None and _runnable(program, uid=plan.get("uid"), masked=[*masked, "/dev", "/proc"],
                                             visible=visible_roots(readonly))


def _program(file: str, path: str | None) -> str | None:
    """The file execvp would run for ``file`` (the shim's own search), or
    None when that depends on the working directory (the workspace)."""
    if not file.startswith("/") and ("/" in file or any(not d.startswith("/") for d in (path or "").split(":"))):
        return None
    return next(iter(shim_exec.program_paths(file, {"PATH": path or ""})), None)


def _runnable(program: str, *, uid: int | None, masked: list[str], visible: list[str]) -> bool:
    real = os.path.realpath(program)
    if not any(real == path or real.startswith(path.rstrip("/") + "/") for path in visible) or any(real == path or real.startswith(path.rstrip("/") + "/") for path in masked):
        return False
    if uid is None:  # the step runs as this worker
        return os.path.isfile(real) and os.access(real, os.X_OK)
    try:
        mode = os.stat(real).st_mode
        # An id of its own is never a file's owner or group: the "other" bits decide.
        return stat.S_ISREG(mode) and bool(mode & stat.S_IXOTH) and all(
            os.stat(parent).st_mode & stat.S_IXOTH for parent in Path(real).parents)
    except OSError:
        return False


def claim_launch(directory: Path, handle_id: str) -> int:
    """Claim the launch of a prepared handle -> the open ``launch.json``,
    filled in once the step's process is started. One process per handle,
    even when a redelivered task races the first one: a second claim raises
    ``invalid_input``."""
    try:
        return os.open(directory / LAUNCH_FILE, os.O_WRONLY | os.O_CREAT | (os.O_EXCL if _fenced() else os.O_TRUNC),
                       0o600)
    except FileExistsError:
        raise EnvelopeError.of(
            "invalid_input", f"handle {handle_id} was already launched", details={"handle_id": handle_id}
        ) from None


def _fenced() -> bool:
    """A handle is launched once, the data plane's own fence behind the
    step claim's (runs/execution.py). ``EXECGO_TEST_SKIP_FENCING`` drops
    both: the deliberately broken build of the fault tests, refused
    anywhere else (system check execgo.E001)."""
    return not settings.EXECGO_TEST_SKIP_FENCING


def release_launch(directory: Path) -> None:
    """Nothing started after ``claim_launch``: the handle may be launched again."""
    os.unlink(directory / LAUNCH_FILE)


def track_child(pid: int) -> None:
    """A step's process that is this process's child: reaped once it ends."""
    _spawned.add(pid)


def reap_spawned() -> None:
    for pid in list(_spawned):
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == 0:
                continue
        except ChildProcessError:
            pass
        _spawned.discard(pid)


def _spawn_directly(directory: Path, *, pid_namespace: bool) -> int:
    argv = shim_command(str(directory))
    unshare = settings.EXECGO_UNSHARE_PATH
    if pid_namespace and os.geteuid() == 0 and os.path.exists(unshare):
        # The shim becomes PID 1 of a new namespace (see runtime/shim.py);
        # --kill-child: if unshare is killed, so is the shim.
        argv = [unshare, "--pid", "--fork", "--kill-child", *argv]
    pid = os.posix_spawn(
        argv[0],
        argv,
        SHIM_ENV,
        setsid=True,
        file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
            (
                os.POSIX_SPAWN_OPEN,
                2,
                str(directory / shim.SHIM_ERR_FILE),
                os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                0o600,
            ),
        ],
    )
    track_child(pid)
    return pid


def warm_shim(plan: dict[str, Any], *, preset: str | None = None) -> forkserver.ShimLink | None:
    """A spare shim (see runtime/forkserver.py) for a step that will run
    with ``plan``'s isolation, forked while the caller does other work; for
    ``launch(spare=…)``. ``preset``: a ``sandbox_preset`` for it to
    pre-start. None when the fork server is not in use or not up."""
    if not settings.EXECGO_SHIM_FORKSERVER:
        return None
    return forkserver.spare_shim(shim_python(), str(tasks_dir()),
                                 pid_namespace=plan.get("tree_kill") == "pid_namespace", preset=preset)


def _start_shim(directory: Path, request: dict[str, Any], spare: forkserver.ShimLink | None = None
                ) -> tuple[int, float | None, str, forkserver.ShimLink | None]:
    reap_spawned()
    pid_namespace = request.get("tree_kill") == "pid_namespace"
    if spare is not None:
        if spare.pid_namespace == pid_namespace:
            try:
                pid, created = spare.go(str(directory))
                return pid, created, "spare", spare
            except forkserver.ForkServerUnavailable as exc:
                logger.info("spare shim unavailable, starting one: %s", exc)
        spare.close()
    pid, created, via, link = None, None, "spawn", None
    if settings.EXECGO_SHIM_FORKSERVER:
        try:
            pid, created, link = forkserver.spawn_shim(
                shim_python(),
                str(tasks_dir()),
                str(directory),
                pid_namespace=pid_namespace,
                idle_s=settings.EXECGO_SHIM_FORKSERVER_IDLE_S,
            )
            via = "forkserver"
        except (forkserver.ForkServerUnavailable, OSError, ValueError) as exc:
            logger.warning("shim fork server unavailable, spawning the shim directly: %s", exc)
    if pid is None:
        pid = _spawn_directly(directory, pid_namespace=pid_namespace)
    if created is None:
        try:
            created = shim.proc.process_create_time(pid)  # seconds after boot, as the shim's
        except (OSError, ValueError, IndexError):
            created = None  # already finished: wait() goes straight to result.json
    return pid, created, via, link


def launch(handle_id: str, *, request: dict[str, Any] | None = None, spare: forkserver.ShimLink | None = None
           ) -> ShimHandle:
    """Start the shim for a prepared handle, detached from this process.
    ``request``: the one ``prepare`` wrote, when the caller has it.
    ``spare``: a ``warm_shim`` to start it in; the caller closes it if this
    raises (closing a spare that did start changes nothing for its step)."""
    directory = task_dir(handle_id)
    request = request or load_json(directory / shim.REQUEST_FILE)
    if request is None:
        raise EnvelopeError.of("not_found", f"handle {handle_id} was not prepared", details={"handle_id": handle_id})
    claim = claim_launch(directory, handle_id)
    try:
        pid, created, via, link = _start_shim(directory, request, spare)
    except BaseException:
        os.close(claim)
        release_launch(directory)
        raise
    with os.fdopen(claim, "w") as fh:
        fh.write(json.dumps({"pid": pid, "create_time": created, "via": via}))
    return ShimHandle(handle_id=handle_id, pid=pid, create_time=created, via=via, link=link)
