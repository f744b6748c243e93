"""An ``http`` step in a process of its own, so that it holds no pool
process while it waits on the network
(docs/data-plane.md#steps-that-do-not-hold-a-worker).

The pool process forks: the child, already set up as a worker, runs the
step's driver (``runtime.tools.http``: the egress guard, the helper of each
hop, the redirects) in a session of its own, writes the step's result.json
and exits. To everyone else it is a shim: ``launch.json`` names its pid
and start time (the claim that makes a second launch of the handle fail),
``attach.wait`` wakes on its pidfd, hands it to the watcher after
``EXECGO_STEP_HAND_OFF_S`` like any shim, and a restarted worker
re-attaches it the same way. Cancelling it is the shims' protocol too: the
``cancel`` file (read when it starts) and SIGTERM, which stops the hop's
helper and ends the step ``cancelled``.

The child never returns into the pool process's code: whatever happens, it
leaves through ``os._exit``, touching none of the connections it
inherited (the database's, the broker's).
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime import shim
from runtime.envelopes import error_envelope, failed_result
from runtime.launcher import ShimHandle, claim_launch, release_launch, track_child
from runtime.layout import task_dir, write_json_atomic

# The signals the pool process may have handlers of its own for; in the
# child each is back to what a plain process does, SIGTERM aside.
RESET_SIGNALS = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD,
                 signal.SIGALRM)


class Cancelled(BaseException):
    """SIGTERM in the child: the step is being cancelled."""


def launch(handle_id: str, *, tool: str, attempt: int, run: Callable[[], dict[str, Any]]) -> ShimHandle:
    """Fork the process that runs ``run`` (-> the step's result envelope)
    for the prepared ``handle_id``; raises ``invalid_input`` when the
    handle was launched already."""
    directory = task_dir(handle_id)
    claim = claim_launch(directory, handle_id)
    # SIGTERM is held from before the fork until the child's own handler is
    # in place: a cancel that comes at once still ends the step "cancelled".
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        pid = os.fork()
        if pid == 0:
            os.close(claim)
            _child(directory, tool=tool, attempt=attempt, handle_id=handle_id, run=run, mask=held)
    except BaseException:
        os.close(claim)
        release_launch(directory)
        raise
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    track_child(pid)
    try:
        created = shim.proc.process_create_time(pid)
    except (OSError, ValueError, IndexError):
        created = None  # already ended: the waiter goes straight to result.json
    with os.fdopen(claim, "w") as fh:
        fh.write(json.dumps({"pid": pid, "create_time": created, "via": "fork"}))
    return ShimHandle(handle_id=handle_id, pid=pid, create_time=created, via="fork")


def _child(directory: Path, *, tool: str, attempt: int, handle_id: str, run: Callable[[], dict[str, Any]],
           mask: set) -> None:
    status = 1
    started = time.time()
    try:
        os.setsid()  # the worker's terminal and process group are not the step's
        for number in RESET_SIGNALS:
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C at the worker's console: the step runs on
        signal.signal(signal.SIGTERM, _on_term)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        try:
            if (directory / shim.CANCEL_FILE).exists():
                raise Cancelled
            envelope = run()
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the result is written whole
        except Cancelled:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            envelope = failed_result(handle_id, error_envelope("cancelled", "the step was cancelled"),
                                     attempt=attempt, started_at=started, finished_at=time.time())
        write_json_atomic(directory / shim.RESULT_FILE, {"tool": tool, "envelope": envelope})
        status = 0
    except BaseException:
        try:
            with open(directory / shim.SHIM_ERR_FILE, "a") as err:
                traceback.print_exc(file=err)
        except BaseException:
            pass
    finally:
        os._exit(status)


def _on_term(_signum, _frame) -> None:
    raise Cancelled
