"""Watch a launched step: liveness, cancel, its result, and waiting for it.

The worker that launched a shim through the fork server waits on the
shim's link, which says ``done`` the moment result.json is written; any
other waiter (re-attaching after a worker restart, or a shim spawned
directly) waits on a pidfd of the shim, waking the moment it exits.
Neither polls for result.json. A shim is told apart from a process that
reused its pid by its create time.

Cancellation never goes through the broker: ``cancel`` writes the ``cancel``
file (seen by the shim even if it starts later) and sends the shim SIGTERM.
"""

from __future__ import annotations

import json
import os
import select
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from django.conf import settings

from runtime import shim
from runtime.envelopes import EnvelopeError
from runtime.forkserver import ShimLink
from runtime.launcher import ShimHandle, reap_spawned
from runtime.layout import LAUNCH_FILE, load_json, task_dir, write_json_atomic
from runtime.tools import shell as shell_tool

CREATE_TIME_TOLERANCE_S = 0.05


def shim_info(directory: Path) -> dict[str, Any] | None:
    return load_json(directory / shim.SHIM_FILE) or load_json(directory / LAUNCH_FILE)


def _same_process(info: dict[str, Any]) -> psutil.Process | None:
    """The live process described by info, or None (gone, zombie, or pid
    reused). Its create_time is in seconds after boot, as the shim wrote it."""
    try:
        process = psutil.Process(info["pid"])
        if (
            info.get("create_time") is not None
            and abs(shim.proc.process_create_time(process.pid) - info["create_time"]) > CREATE_TIME_TOLERANCE_S
        ):
            return None
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process
    except (OSError, psutil.NoSuchProcess):
        return None


def shim_alive(handle_id: str) -> bool:
    info = shim_info(task_dir(handle_id))
    return bool(info) and _same_process(info) is not None


def cancel(handle_id: str) -> None:
    """Ask the step to stop: durable cancel file, then SIGTERM to a live shim."""
    directory = task_dir(handle_id)
    if not directory.exists():
        return
    fd = os.open(directory / shim.CANCEL_FILE, os.O_WRONLY | os.O_CREAT, 0o600)
    os.close(fd)
    info = shim_info(directory)
    if info and _same_process(info) is not None:
        try:
            os.kill(info["pid"], signal.SIGTERM)
        except ProcessLookupError:
            pass


def read_result(handle_id: str, *, request: dict[str, Any] | None = None) -> dict | None:
    """The step result envelope if the step has finished, else None."""
    directory = task_dir(handle_id)
    raw = load_json(directory / shim.RESULT_FILE)
    if raw is None:
        return None
    if "envelope" in raw:
        return raw["envelope"]
    request = request or load_json(directory / shim.REQUEST_FILE) or {"handle_id": handle_id}
    return shell_tool.result_envelope(raw, request, directory)


def record_shim_failure(directory: Path, message: str) -> None:
    """Leave a result.json so every later read_result agrees on the failure."""
    try:
        with open(directory / shim.SHIM_ERR_FILE, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 2000))
            message += ": " + fh.read().decode(errors="replace").strip()
    except FileNotFoundError:
        pass
    now = time.time()
    write_json_atomic(
        directory / shim.RESULT_FILE,
        {"version": 1, "termination": None, "shim_error": message, "started_at": now, "finished_at": now},
    )


class ProgressTail:
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


def open_pidfd(info: dict[str, Any] | None) -> int | None:
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


def kill_shim(info: dict[str, Any] | None) -> None:
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
    hand_off: Callable[[dict[str, Any] | None, int], bool] | None = None,
    hand_off_after_s: float = 0.0,
) -> dict | None:
    """Block until the step's result exists and return its envelope.

    Works for a shim started by another (possibly dead) process too: that is
    how a restarted worker re-attaches. ``launched`` and ``request``: what
    the caller's own ``launch`` and ``prepare`` gave, saving their reading
    back from disk. ``hand_off``: offered the shim's pid and create time
    (or None: unknown yet) and how many bytes of progress lines were
    recorded, once the step has run ``hand_off_after_s``; if
    it returns True, someone else waits for the step now (``runtime.watcher``)
    and this returns None at once.
    """
    directory = task_dir(handle_id)
    request = request or load_json(directory / shim.REQUEST_FILE)
    if request is None:
        raise EnvelopeError.of("not_found", f"handle {handle_id} was not prepared", details={"handle_id": handle_id})
    progress = ProgressTail(directory / shim.PROGRESS_FILE, on_progress)
    backstop = (
        time.monotonic()
        + float(request["timeout_s"])
        + float(request.get("kill_grace_s", 0.5))
        + settings.EXECGO_SHIM_BACKSTOP_S
    )
    link = launched.link if launched is not None else None
    # A shim forked by the server, or an http step's process, is the launched
    # process itself (a shim spawned under unshare is that process's child:
    # shim.json names it).
    info = None
    if launched is not None and launched.via in ("forkserver", "spare", "fork"):
        info = {"pid": launched.pid, "create_time": launched.create_time}
    hand_off_at = time.monotonic() + hand_off_after_s if hand_off is not None else None
    if not _await_shim_end(handle_id, directory, link=link, info=info, backstop=backstop, progress=progress,
                           cancel_requested=cancel_requested, poll_interval=poll_interval, hand_off=hand_off,
                           hand_off_at=hand_off_at):
        return None
    progress.poll()
    result = read_result(handle_id, request=request)
    assert result is not None  # every path of _await_shim_end leaves a result.json
    return result


def _await_shim_end(handle_id: str, directory: Path, *, link: ShimLink | None, info: dict[str, Any] | None, backstop: float,
                    progress: ProgressTail, cancel_requested: Callable[[], bool] | None,
                    poll_interval: float, hand_off: Callable[[dict[str, Any] | None, int], bool] | None = None,
                    hand_off_at: float | None = None) -> bool:
    """Wait for the shim's end, not just for result.json: when this returns
    True, the step's processes are gone (a shim says "done" only once it
    has killed and reaped them all), and a result.json is there, the shim's
    or one recording why it has none. False: ``hand_off`` took the step
    over (at ``hand_off_at``, unless a cancel was sent meanwhile). Closes
    ``link``."""
    cancel_sent, pidfd = False, None
    result_path = directory / shim.RESULT_FILE
    try:
        while True:
            if link is None and pidfd is None:
                info = info or shim_info(directory)
                pidfd = open_pidfd(info)
                if pidfd is None:
                    if not result_path.exists():
                        record_shim_failure(directory, "the shim is not running and left no result")
                    break
            ready, _, _ = select.select([link or pidfd], [], [], poll_interval)
            progress.poll()
            if ready and (link is None or link.finished()):
                reap_spawned()
                if not result_path.exists():
                    record_shim_failure(directory, "the shim exited without writing result.json")
                break
            if not cancel_sent and cancel_requested is not None and cancel_requested():
                cancel(handle_id)
                cancel_sent = True
            if time.monotonic() > backstop:
                kill_shim(info)
                if not result_path.exists():
                    record_shim_failure(directory, "the shim overran its timeout and was killed")
                break
            if hand_off_at is not None and not cancel_sent and time.monotonic() >= hand_off_at:
                hand_off_at = None  # offered once: if it is refused, this process waits on
                # The progress lines read so far are recorded: the new waiter reads on from there.
                if hand_off(info, progress.offset - len(progress.buffer)):
                    return False
        return True
    finally:
        if pidfd is not None:
            os.close(pidfd)
        if link is not None:
            link.close()
