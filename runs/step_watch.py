"""The harness's side of the step watcher (``runtime.watcher``;
docs/data-plane.md#steps-that-do-not-hold-a-worker): one per worker
process, started once its pool runs.

What the watcher reports becomes harness work here: an ended step is a
task on this host's queue that records its result
(``execution.step_watched_end``: fenced by the attempt, so a duplicate
report is harmless), sent again while its attempt still shows running; a
cancel is the run's ``cancel_requested_at`` or a run no longer EXECUTING,
asked for every watched run in one query per tick; a progress line is
written as the pool process would have.
"""

import logging
from functools import wraps

from django.db import DatabaseError, connections

from runs.dataplane import current_host
from runs.dispatch import enqueue_watched_end
from runs.execution import record_progress
from runs.models import Run, Step, StepRunStatus
from runs.statemachine import RunState
from runtime.watcher import Watched, Watcher

logger = logging.getLogger(__name__)

_watcher: Watcher | None = None


def start() -> Watcher:
    """Start this process's watcher (a worker's main process, once)."""
    global _watcher
    if _watcher is None:
        _watcher = Watcher(ended=_ended, recorded=_recorded, cancelled=_cancelled, progress=_progressed).start()
    return _watcher


def stop() -> None:
    global _watcher
    if _watcher is not None:
        _watcher.stop()
        _watcher = None


def _keeping_its_connections(callback):
    """The watcher's thread keeps its database connections open between
    ticks (opening one per tick costs the database a process); one that
    failed is closed, so the next tick opens another."""

    @wraps(callback)
    def call(*args):
        try:
            return callback(*args)
        except DatabaseError:
            for connection in connections.all(initialized_only=True):
                connection.close()
            raise

    return call


@_keeping_its_connections
def _ended(watched: Watched) -> None:
    # Written as a Dispatch row if the broker refuses it: relayed, never lost.
    enqueue_watched_end(watched.ref["step"], watched.ref["attempt"], current_host())


@_keeping_its_connections
def _recorded(watched: list[Watched]) -> set[str]:
    """The reported steps whose attempt is no longer running: recorded (or
    closed by the sweeper or a cancel meanwhile)."""
    running = set(Step.objects.filter(pk__in={w.ref["step"] for w in watched}, run_status=StepRunStatus.RUNNING)
                  .values_list("pk", "attempt"))
    return {w.handle_id for w in watched if (w.ref["step"], w.ref["attempt"]) not in running}


@_keeping_its_connections
def _cancelled(watched: list[Watched]) -> set[str]:
    if not watched:
        return set()
    runs = set(Run.objects.filter(pk__in={w.ref["run"] for w in watched})
               .exclude(cancel_requested_at=None, state=RunState.EXECUTING).values_list("pk", flat=True))
    return {w.handle_id for w in watched if w.ref["run"] in runs}


@_keeping_its_connections
def _progressed(watched: Watched, percent: int, message: str) -> None:
    step = Step.objects.filter(pk=watched.ref["step"], attempt=watched.ref["attempt"],
                               run_status=StepRunStatus.RUNNING).first()
    if step is not None:
        record_progress(step.run_id, step, watched.ref["attempt"], percent, message)
