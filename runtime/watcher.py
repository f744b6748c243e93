"""A worker's step watcher: waiting for launched shims without holding a
pool process (docs/data-plane.md#steps-that-do-not-hold-a-worker).

A pool process launches a step's shim and waits for it a moment
(``EXECGO_STEP_HAND_OFF_S``): a quick step ends there and the pool process
records it at once. A step still running then is handed to the watcher, a
thread of the worker's main process, and the pool process is free for other
work. The watcher waits on every handed step's pidfd at once (one
``epoll``), and on each tick tails their progress files, asks whether any
of their runs is being cancelled, and kills a shim that overran its
timeout by ``EXECGO_SHIM_BACKSTOP_S``, as ``attach.wait`` does for one.
When a shim has ended, the watcher reports it (``ended``: the harness
sends a task that records the result); a report that fails (the broker and
the database both down) is tried again every tick, never dropped. A report
the broker took is not forgotten either: until ``recorded`` says the
result is in, it is sent again after ``REPORT_AGAIN_S``, then twice as
long each time (a broker restarted empty loses what it held).

Hand-off is a datagram on an abstract unix socket named after the worker's
main process, which only its own pool processes may use: the kernel tells
the sender's pid (``SO_PASSCRED``) and a sender that is not a child of the
watcher's process is ignored. Sandboxed steps have a network namespace of
their own and cannot reach the socket at all. Nothing is lost when the
worker dies: the steps are marked running on this host, and the next
worker's recovery re-attaches them (``runs.worker_start``).

This module knows nothing of runs: what a report, a cancel check and a
progress line mean is the caller's (``runs.step_watch``).
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import psutil
from django.conf import settings

from runtime import shim
from runtime.attach import (
    ProgressTail,
    cancel,
    kill_shim,
    open_pidfd,
    record_shim_failure,
    shim_info,
)
from runtime.capabilities import host_name
from runtime.layout import load_json, task_dir

logger = logging.getLogger(__name__)

MAX_MESSAGE = 4096
REPORT_AGAIN_S, REPORT_AGAIN_MAX_S = 5.0, 60.0
CONFIRM_EVERY_S = 1.0
UCRED = struct.Struct("3i")  # pid, uid, gid
SEND_TIMEOUT_S = 1.0


def address(pid: int) -> str:
    """The abstract socket of the watcher in process ``pid`` on this host."""
    return f"\0execgo-step-watcher/{host_name()}/{pid}"


def hand_off(handle_id: str, *, ref: dict[str, Any], info: dict[str, Any] | None, progress_offset: int = 0) -> bool:
    """Give the waiting for ``handle_id``'s launched shim to the watcher of
    this pool process's worker. ``ref``: what the watcher hands back with
    its reports; ``info``: the shim's pid and create time when known (else
    the watcher reads shim.json); ``progress_offset``: the bytes of its
    progress file already recorded. False when no watcher took it (no
    watcher in the parent process: a solo pool, a test calling in-process):
    the caller then waits itself."""
    message = json.dumps({"handle_id": handle_id, "ref": ref, "info": info,
                          "progress_offset": progress_offset}).encode()
    if len(message) > MAX_MESSAGE:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.settimeout(SEND_TIMEOUT_S)
        try:
            sock.sendto(message, address(os.getppid()))
        except OSError:  # nobody listens there, or its queue stayed full
            return False
    return True


@dataclass
class Watched:
    """A handed-off step: its shim, and what the caller named it by."""

    handle_id: str
    ref: dict[str, Any]
    backstop: float  # time.monotonic() past which the shim is killed
    info: dict[str, Any] | None = None
    pidfd: int | None = None
    progress: ProgressTail | None = field(default=None, repr=False)
    cancel_sent: bool = False
    ended: bool = False


class Watcher:
    """The watcher thread of one worker (``start``/``stop``). ``ended``: a
    step's shim is gone and its result.json written (raise to be called
    again next tick); ``recorded``: which of the reported steps have their
    result recorded (handle ids; the others are reported again in time);
    ``cancelled``: which of the watched steps are to be cancelled (handle
    ids); ``progress``: a progress line of a step."""

    def __init__(self, *, ended: Callable[[Watched], None], recorded: Callable[[list[Watched]], Iterable[str]],
                 cancelled: Callable[[list[Watched]], Iterable[str]],
                 progress: Callable[[Watched, int, str], None], tick_s: float = 0.1,
                 report_again_s: float = REPORT_AGAIN_S):
        self.ended, self.recorded, self.cancelled, self.progress = ended, recorded, cancelled, progress
        self.tick_s, self.report_again_s = tick_s, report_again_s
        self.watched: dict[str, Watched] = {}
        self.unreported: list[Watched] = []
        # Reported, not yet seen recorded: handle -> (watched, when to report again, the wait after that).
        self.reported: dict[str, tuple[Watched, float, float]] = {}
        self.next_confirm = 0.0
        self.selector = selectors.DefaultSelector()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(address(os.getpid()))
        self.sock.setblocking(False)
        self.selector.register(self.sock, selectors.EVENT_READ)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="execgo-step-watcher", daemon=True)

    def start(self) -> Watcher:
        self.thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop watching; the steps still running are the next worker's to
        re-attach (their shims run on)."""
        self.stopping.set()
        self.thread.join(timeout)

    # The loop: hand-offs and ended shims as they come, the rest each tick.
    def _loop(self) -> None:
        next_tick = time.monotonic()
        try:
            while not self.stopping.is_set():
                for key, _events in self.selector.select(max(next_tick - time.monotonic(), 0)):
                    try:
                        if key.fileobj is self.sock:
                            self._receive()
                        else:
                            self._end(key.data)
                    except Exception:
                        logger.exception("the step watcher could not handle an event")
                if time.monotonic() >= next_tick:
                    try:
                        self._tick()
                    except Exception:
                        logger.exception("the step watcher's tick failed")
                    next_tick = time.monotonic() + self.tick_s
        finally:
            # Nothing may queue for a watcher that is gone: pool processes wait themselves then.
            self.selector.close()
            self.sock.close()
            for watched in self.watched.values():
                if watched.pidfd is not None:
                    os.close(watched.pidfd)

    def _receive(self) -> None:
        while True:
            try:
                data, ancillary, _flags, _address = self.sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(UCRED.size))
            except BlockingIOError:
                return
            sender = next((UCRED.unpack(bytes(cdata[:UCRED.size]))[0] for level, kind, cdata in ancillary
                           if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS), None)
            if not self._is_my_pool_process(sender):
                logger.warning("the step watcher ignored a hand-off from pid %s, not one of its pool processes",
                               sender)
                continue
            try:
                message = json.loads(data)
                self.watch(str(message["handle_id"]), ref=dict(message["ref"]), info=message.get("info"),
                           progress_offset=int(message.get("progress_offset") or 0))
            except (ValueError, KeyError, TypeError) as exc:
                logger.warning("the step watcher ignored a malformed hand-off: %s", exc)

    @staticmethod
    def _is_my_pool_process(pid: int | None) -> bool:
        try:
            return pid is not None and psutil.Process(pid).ppid() == os.getpid()
        except psutil.Error:
            return False

    def watch(self, handle_id: str, *, ref: dict[str, Any], info: dict[str, Any] | None = None,
              progress_offset: int = 0) -> None:
        """Watch ``handle_id``'s shim (a second hand-off of it is ignored)."""
        if handle_id in self.watched or handle_id in self.reported:
            return
        directory = task_dir(handle_id)
        request = load_json(directory / shim.REQUEST_FILE) or {}
        backstop = (time.monotonic() + float(request.get("timeout_s", settings.EXECGO_STEP_TIMEOUT_S))
                    + float(request.get("kill_grace_s", 0.5)) + settings.EXECGO_SHIM_BACKSTOP_S)
        watched = Watched(handle_id, ref, backstop, info=info or shim_info(directory))
        watched.progress = ProgressTail(directory / shim.PROGRESS_FILE,
                                         lambda percent, message: self.progress(watched, percent, message))
        watched.progress.offset = progress_offset
        self.watched[handle_id] = watched
        watched.pidfd = open_pidfd(watched.info)
        logger.debug("watching step %s (shim %s)", handle_id, watched.info)
        if watched.pidfd is None:  # it ended before it was handed over
            self._end(watched)
        else:
            self.selector.register(watched.pidfd, selectors.EVENT_READ, watched)

    def _end(self, watched: Watched, reason: str = "the shim exited without writing result.json") -> None:
        if watched.ended:
            return
        watched.ended = True
        if watched.pidfd is not None:
            self.selector.unregister(watched.pidfd)
            os.close(watched.pidfd)
            watched.pidfd = None
        watched.progress.poll()
        if not (task_dir(watched.handle_id) / shim.RESULT_FILE).exists():
            record_shim_failure(task_dir(watched.handle_id), reason)
        self.unreported.append(watched)
        logger.debug("step %s ended", watched.handle_id)
        self._report()

    def _report(self) -> None:
        """Report ended steps, oldest first; those that fail stay for the next tick."""
        left = []
        for watched in self.unreported:
            if left:
                left.append(watched)
                continue
            try:
                self.ended(watched)
                self.watched.pop(watched.handle_id, None)
                self.reported[watched.handle_id] = (watched, time.monotonic() + self.report_again_s,
                                                    self.report_again_s)
            except Exception:
                logger.exception("could not report the end of step %s; trying again", watched.handle_id)
                left.append(watched)
        self.unreported = left

    def _tick(self) -> None:
        if self.unreported:
            self._report()
        if self.reported and time.monotonic() >= self.next_confirm:
            self._confirm()
        running = [watched for watched in self.watched.values() if not watched.ended]
        if not running:
            return
        for watched in running:
            watched.progress.poll()
        to_cancel = set(self.cancelled([watched for watched in running if not watched.cancel_sent]))
        now = time.monotonic()
        for watched in running:
            if watched.handle_id in to_cancel:
                cancel(watched.handle_id)
                watched.cancel_sent = True
            if now > watched.backstop:
                kill_shim(watched.info)
                self._end(watched, "the shim overran its timeout and was killed")

    def _confirm(self) -> None:
        """Forget the reports whose result is recorded; send again those that
        are overdue (the broker may have lost them)."""
        self.next_confirm = time.monotonic() + CONFIRM_EVERY_S
        for handle_id in set(self.recorded([watched for watched, _at, _wait in self.reported.values()])):
            self.reported.pop(handle_id, None)
        now = time.monotonic()
        for handle_id, (watched, at, wait) in list(self.reported.items()):
            if now < at:
                continue
            try:
                self.ended(watched)
            except Exception:
                logger.exception("could not report the end of step %s again", handle_id)
                continue
            logger.warning("step %s: its end reported again, its result still not recorded after %.0f s",
                           handle_id, wait)
            wait = min(wait * 2, REPORT_AGAIN_MAX_S)
            self.reported[handle_id] = (watched, now + wait, wait)
