"""Launch, wait, re-attach: the seam between the harness and the data plane.

Layout of one step (``EXECGO_TASKS_DIR/<handle_id>/``)::

    request.json    what to run (written by prepare)
    launch.json     shim pid + create time; created exclusively by the one
                    launch of this handle (empty until the shim is started)
    shim.json       the same, written by the shim itself once it runs
    stdout.log, stderr.log, progress.jsonl, shim.err, stdin, cancel
    result.json     the shim's facts (shell) or the envelope (http, file)
    workspace/      the command's working directory

Shell steps run in a shim (see runtime/shim.py) that is started without
``preexec_fn`` (from the fork server, or by ``posix_spawn`` in a new
session) and never is a child the worker must keep alive: if the worker is
SIGKILLed the shim finishes, writes result.json, and a restarted worker
re-attaches with ``shim_alive`` / ``wait`` / ``read_result``. The worker
that launched a shim through the fork server waits on the shim's link,
which says ``done`` the moment result.json is written; any other waiter
(re-attaching, or a shim spawned directly) waits on a pidfd of the shim,
waking the moment it exits. Neither polls for result.json. ``http`` and
``file`` run in the worker.

Cancellation never goes through the broker: ``cancel`` writes the ``cancel``
file (seen by the shim even if it starts later) and sends the shim SIGTERM.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from django.conf import settings

from runtime import forkserver, shim
from runtime.envelopes import EnvelopeError, error_envelope, failed_result, step_result
from runtime.plans import resolve_plan
from runtime.tools import file as file_tool
from runtime.tools import http as http_tool
from runtime.tools import shell as shell_tool
from runtime.tools import validate_params

logger = logging.getLogger(__name__)

HANDLE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
LAUNCH_FILE = "launch.json"
WORKSPACE_DIR = "workspace"
SHIM_PATH = str(Path(shim.__file__).resolve())
SHIM_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
CREATE_TIME_TOLERANCE_S = 0.05

# Shims started by posix_spawn are our children until reaped.
_spawned: set[int] = set()


@dataclass(frozen=True)
class ShimHandle:
    handle_id: str
    pid: int
    create_time: float | None
    via: str  # "forkserver" | "spare" (forked by the server ahead of its step) | "spawn"
    # The fork server's shims report "done" on it (see forkserver.ShimLink).
    link: forkserver.ShimLink | None = field(default=None, compare=False)


# --- paths and settings -------------------------------------------------------------


def tasks_dir() -> Path:
    return Path(settings.EXECGO_TASKS_DIR)


def task_dir(handle_id: str) -> Path:
    if not isinstance(handle_id, str) or not HANDLE_ID.match(handle_id):
        raise EnvelopeError.of("invalid_input", f"bad handle id {handle_id!r}", details={"pattern": HANDLE_ID.pattern})
    return tasks_dir() / handle_id


def shim_python() -> str:
    return getattr(settings, "EXECGO_SHIM_PYTHON", None) or sys.executable


def shim_command(*args: str) -> list[str]:
    return [shim_python(), "-I", "-S", SHIM_PATH, *args]


def _load_json(path: Path) -> dict[str, Any] | None:
    """The file's JSON, or None when it is missing or still being written."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _write_json_atomic(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


# --- prepare ------------------------------------------------------------------------


def prepare(handle_id: str, *, tool: str, params: dict, timeout_s: float, attempt: int, plan: dict) -> Path:
    """Write tasks/<handle_id>/request.json and create workspace/.

    ``plan`` is the effective plan from ``resolve_plan``; a bare requested
    sandbox (``{"profile", "limits"}``) is resolved here, adaptively.
    """
    return _prepare(handle_id, tool=tool, params=params, timeout_s=timeout_s, attempt=attempt, plan=plan)[0]


def _prepare(handle_id: str, *, tool: str, params: dict, timeout_s: float, attempt: int, plan: dict
             ) -> tuple[Path, dict[str, Any]]:
    """``prepare`` -> the task directory and the request written there."""
    validate_params(tool, params)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s < 7 * 86400:
        raise EnvelopeError.of("invalid_input", "timeout_s must be a positive number of seconds")
    plan = dict(plan or {})
    if not {"profile", "limits", "tree_kill"} <= plan.keys():
        plan = resolve_plan({key: plan[key] for key in ("profile", "limits") if key in plan})
    directory = task_dir(handle_id)
    if any((directory / name).exists() for name in (LAUNCH_FILE, shim.SHIM_FILE, shim.RESULT_FILE)):
        raise EnvelopeError.of(
            "invalid_input", f"handle {handle_id} was already launched", details={"handle_id": handle_id}
        )
    workspace = directory / WORKSPACE_DIR
    workspace.mkdir(parents=True, exist_ok=True)
    os.chmod(workspace, 0o755)
    owner = plan.get("uid")
    group = plan.get("gid") if plan.get("gid") is not None else owner
    if owner is not None and os.geteuid() == 0:
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
        command = shell_tool.build_request(params, handle_id=handle_id, workspace=workspace, plan=plan)
        Path(command["cwd"]).mkdir(parents=True, exist_ok=True)
        if owner is not None and os.geteuid() == 0:
            for path in Path(command["cwd"]).relative_to(workspace).parents:
                os.chown(workspace / path, owner, group)
            os.chown(command["cwd"], owner, group)
        if command["stdin"]:
            (directory / shim.STDIN_FILE).write_text(params["stdin"])
        request.update(command)
        request.update(
            {
                "limits": plan["limits"],
                "uid": plan.get("uid"),
                "gid": plan.get("gid"),
                "tree_kill": plan["tree_kill"],
                "kill_grace_s": getattr(settings, "EXECGO_KILL_GRACE_S", 0.5),
                "drain_grace_s": getattr(settings, "EXECGO_DRAIN_GRACE_S", 0.2),
            }
        )
    _write_json_atomic(directory / shim.REQUEST_FILE, request)
    return directory, request


# --- launch ----------------------------------------------------------------------------


def _reap_spawned() -> None:
    for pid in list(_spawned):
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == 0:
                continue
        except ChildProcessError:
            pass
        _spawned.discard(pid)


def _spawn_directly(directory: Path, *, pid_namespace: bool) -> int:
    argv = shim_command(str(directory))
    unshare = getattr(settings, "EXECGO_UNSHARE_PATH", "/usr/bin/unshare")
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
                0o644,
            ),
        ],
    )
    _spawned.add(pid)
    return pid


def warm_shim(plan: dict[str, Any]) -> forkserver.ShimLink | None:
    """A spare shim (see runtime/forkserver.py) for a step that will run
    with ``plan``'s isolation, forked while the caller does other work; for
    ``launch(spare=…)``. None when the fork server is not in use or not up."""
    if not getattr(settings, "EXECGO_SHIM_FORKSERVER", True):
        return None
    return forkserver.spare_shim(shim_python(), str(tasks_dir()),
                                 pid_namespace=plan.get("tree_kill") == "pid_namespace")


def _start_shim(directory: Path, request: dict[str, Any], spare: forkserver.ShimLink | None = None
                ) -> tuple[int, float | None, str, forkserver.ShimLink | None]:
    _reap_spawned()
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
    if getattr(settings, "EXECGO_SHIM_FORKSERVER", True):
        try:
            pid, created, link = forkserver.spawn_shim(
                shim_python(),
                str(tasks_dir()),
                str(directory),
                pid_namespace=pid_namespace,
                idle_s=getattr(settings, "EXECGO_SHIM_FORKSERVER_IDLE_S", 600),
            )
            via = "forkserver"
        except (forkserver.ForkServerUnavailable, OSError, ValueError) as exc:
            logger.warning("shim fork server unavailable, spawning the shim directly: %s", exc)
    if pid is None:
        pid = _spawn_directly(directory, pid_namespace=pid_namespace)
    if created is None:
        try:
            created = psutil.Process(pid).create_time()
        except psutil.NoSuchProcess:
            created = None  # already finished: wait() goes straight to result.json
    return pid, created, via, link


def launch(handle_id: str, *, request: dict[str, Any] | None = None, spare: forkserver.ShimLink | None = None
           ) -> ShimHandle:
    """Start the shim for a prepared handle, detached from this process.
    ``request``: the one ``prepare`` wrote, when the caller has it.
    ``spare``: a ``warm_shim`` to start it in; the caller closes it if this
    raises (closing a spare that did start changes nothing for its step)."""
    directory = task_dir(handle_id)
    request = request or _load_json(directory / shim.REQUEST_FILE)
    if request is None:
        raise EnvelopeError.of("not_found", f"handle {handle_id} was not prepared", details={"handle_id": handle_id})
    try:
        # One shim per handle, even when a redelivered task races the first
        # one: launch.json is the claim, filled in once the shim is started.
        claim = os.open(directory / LAUNCH_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise EnvelopeError.of(
            "invalid_input", f"handle {handle_id} was already launched", details={"handle_id": handle_id}
        ) from None
    try:
        pid, created, via, link = _start_shim(directory, request, spare)
    except BaseException:
        os.close(claim)
        os.unlink(directory / LAUNCH_FILE)  # nothing started: the handle may be launched again
        raise
    with os.fdopen(claim, "w") as fh:
        fh.write(json.dumps({"pid": pid, "create_time": created, "via": via}))
    return ShimHandle(handle_id=handle_id, pid=pid, create_time=created, via=via, link=link)


# --- liveness, cancel, results -------------------------------------------------------------


def _shim_info(directory: Path) -> dict[str, Any] | None:
    return _load_json(directory / shim.SHIM_FILE) or _load_json(directory / LAUNCH_FILE)


def _same_process(info: dict[str, Any]) -> psutil.Process | None:
    """The live process described by info, or None (gone, zombie, or pid reused)."""
    try:
        process = psutil.Process(info["pid"])
        if (
            info.get("create_time") is not None
            and abs(process.create_time() - info["create_time"]) > CREATE_TIME_TOLERANCE_S
        ):
            return None
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process
    except psutil.NoSuchProcess:
        return None


def shim_alive(handle_id: str) -> bool:
    info = _shim_info(task_dir(handle_id))
    return bool(info) and _same_process(info) is not None


def cancel(handle_id: str) -> None:
    """Ask the step to stop: durable cancel file, then SIGTERM to a live shim."""
    directory = task_dir(handle_id)
    if not directory.exists():
        return
    fd = os.open(directory / shim.CANCEL_FILE, os.O_WRONLY | os.O_CREAT, 0o644)
    os.close(fd)
    info = _shim_info(directory)
    if info and _same_process(info) is not None:
        try:
            os.kill(info["pid"], signal.SIGTERM)
        except ProcessLookupError:
            pass


def read_result(handle_id: str, *, request: dict[str, Any] | None = None) -> dict | None:
    """The step result envelope if the step has finished, else None."""
    directory = task_dir(handle_id)
    raw = _load_json(directory / shim.RESULT_FILE)
    if raw is None:
        return None
    if "envelope" in raw:
        return raw["envelope"]
    request = request or _load_json(directory / shim.REQUEST_FILE) or {"handle_id": handle_id}
    return shell_tool.result_envelope(raw, request, directory)


def _record_shim_failure(directory: Path, message: str) -> None:
    """Leave a result.json so every later read_result agrees on the failure."""
    try:
        with open(directory / shim.SHIM_ERR_FILE, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 2000))
            message += ": " + fh.read().decode(errors="replace").strip()
    except FileNotFoundError:
        pass
    now = time.time()
    _write_json_atomic(
        directory / shim.RESULT_FILE,
        {"version": 1, "termination": None, "shim_error": message, "started_at": now, "finished_at": now},
    )


# --- wait ------------------------------------------------------------------------------------


class _ProgressTail:
    def __init__(self, path: Path, callback: Callable[[int, str], None] | None):
        self.path, self.callback, self.offset, self.buffer = path, callback, 0, b""

    def poll(self) -> None:
        if self.callback is None:
            return
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return
        self.offset += len(data)
        lines = (self.buffer + data).split(b"\n")
        self.buffer = lines.pop()
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            self.callback(int(record["percent"]), str(record.get("message", "")))


def _open_pidfd(info: dict[str, Any] | None) -> int | None:
    if not info:
        return None
    try:
        fd = os.pidfd_open(info["pid"])
    except ProcessLookupError:
        return None
    # Checked after opening: the pidfd pins this exact process, so a pid
    # reused between the check and the open cannot fool us.
    if _same_process(info) is None:
        os.close(fd)
        return None
    return fd


def _kill_shim(info: dict[str, Any] | None) -> None:
    if info and _same_process(info) is not None:
        try:
            # As PID 1 the shim takes its namespace along; without one the
            # command has PDEATHSIG set and dies with it.
            os.kill(info["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait(
    handle_id: str,
    *,
    cancel_requested: Callable[[], bool] | None = None,
    on_progress: Callable[[int, str], None] | None = None,
    poll_interval: float = 0.02,
    launched: ShimHandle | None = None,
    request: dict[str, Any] | None = None,
) -> dict:
    """Block until the step's result exists and return its envelope.

    Works for a shim started by another (possibly dead) process too: that is
    how a restarted worker re-attaches. ``launched`` and ``request``: what
    the caller's own ``launch`` and ``prepare`` gave, saving their reading
    back from disk.
    """
    directory = task_dir(handle_id)
    request = request or _load_json(directory / shim.REQUEST_FILE)
    if request is None:
        raise EnvelopeError.of("not_found", f"handle {handle_id} was not prepared", details={"handle_id": handle_id})
    result_path = directory / shim.RESULT_FILE
    progress = _ProgressTail(directory / shim.PROGRESS_FILE, on_progress)
    backstop = (
        time.monotonic()
        + float(request["timeout_s"])
        + float(request.get("kill_grace_s", 0.5))
        + getattr(settings, "EXECGO_SHIM_BACKSTOP_S", 30.0)
    )
    cancel_sent, pidfd = False, None
    link = launched.link if launched is not None else None
    # A shim forked by the server is the launched process itself (one spawned
    # under unshare is that process's child: shim.json names it).
    info = None
    if launched is not None and launched.via in ("forkserver", "spare"):
        info = {"pid": launched.pid, "create_time": launched.create_time}
    try:
        # Wait for the shim's end, not just for result.json: when wait()
        # returns, the step's processes are gone (a shim says "done" only
        # once it has killed and reaped them all).
        while True:
            if link is None and pidfd is None:
                info = info or _shim_info(directory)
                pidfd = _open_pidfd(info)
                if pidfd is None:
                    if not result_path.exists():
                        _record_shim_failure(directory, "the shim is not running and left no result")
                    break
            ready, _, _ = select.select([link or pidfd], [], [], poll_interval)
            progress.poll()
            if ready and (link is None or link.finished()):
                _reap_spawned()
                if not result_path.exists():
                    _record_shim_failure(directory, "the shim exited without writing result.json")
                break
            if not cancel_sent and cancel_requested is not None and cancel_requested():
                cancel(handle_id)
                cancel_sent = True
            if time.monotonic() > backstop:
                _kill_shim(info)
                if not result_path.exists():
                    _record_shim_failure(directory, "the shim overran its timeout and was killed")
                break
    finally:
        if pidfd is not None:
            os.close(pidfd)
        if link is not None:
            link.close()
    progress.poll()
    result = read_result(handle_id, request=request)
    assert result is not None  # every path above leaves a result.json
    return result


# --- execute -------------------------------------------------------------------------------


def execute(
    handle_id: str,
    *,
    tool: str,
    params: dict,
    timeout_s: float,
    attempt: int,
    plan: dict,
    cancel_requested: Callable[[], bool] | None = None,
    on_progress: Callable[[int, str], None] | None = None,
    spare: forkserver.ShimLink | None = None,
) -> dict:
    """Run one tool call to its end and return the step result envelope.
    ``spare``: a ``warm_shim`` for a shell step (closed unused otherwise)."""
    started = time.time()
    try:
        directory, request = _prepare(handle_id, tool=tool, params=params, timeout_s=timeout_s, attempt=attempt,
                                      plan=plan)
        if tool == "shell":
            launched = launch(handle_id, request=request, spare=spare)
            spare = None  # started in, or closed by, launch
            return wait(handle_id, cancel_requested=cancel_requested, on_progress=on_progress, launched=launched,
                        request=request)
    except EnvelopeError as exc:
        return failed_result(handle_id, exc.envelope, attempt=attempt, started_at=started, finished_at=time.time())
    except OSError as exc:
        error = error_envelope("internal", f"cannot start the step: {exc}", retryable=True)
        return failed_result(handle_id, error, attempt=attempt, started_at=started, finished_at=time.time())
    finally:
        if spare is not None:
            spare.close()  # unused: it exits when its link closes

    if cancel_requested is not None and cancel_requested():
        envelope = failed_result(
            handle_id, error_envelope("cancelled", "the step was cancelled before it started"),
            attempt=attempt, started_at=started, finished_at=time.time(),
        )  # fmt: skip
    else:
        envelope = _run_in_process(handle_id, tool, params, timeout_s, attempt, directory / WORKSPACE_DIR, started)
    _write_json_atomic(directory / shim.RESULT_FILE, {"tool": tool, "envelope": envelope})
    return envelope


def _run_in_process(
    handle_id: str, tool: str, params: dict, timeout_s: float, attempt: int, workspace: Path, started: float
) -> dict:
    try:
        if tool == "http":
            output, details, error = http_tool.run(params, timeout_s=timeout_s)
        else:
            output, details = file_tool.run(params, workspace=workspace)
            error = None
    except EnvelopeError as exc:
        return failed_result(handle_id, exc.envelope, attempt=attempt, started_at=started, finished_at=time.time())
    except OSError as exc:
        error = error_envelope("external_failure", f"{tool} failed: {exc}", details={"errno": exc.errno})
        return failed_result(handle_id, error, attempt=attempt, started_at=started, finished_at=time.time())
    status = "success" if error is None else "failed"
    return step_result(
        status=status,
        handle_id=handle_id,
        output=output,
        started_at=started,
        finished_at=time.time(),
        attempt=attempt,
        details=details,
        error=error,
    )
