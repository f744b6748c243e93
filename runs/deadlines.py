"""The deadline scan: a run's total time is enforced within seconds of its
deadline, whatever happened to its timer.

The fast path is the timer armed when EXECUTING starts (a ``settle_run``
message with an ETA, ``settle.executing_started``). That message lives
in a worker's memory until it is due: a worker killed with ``kill -9``
leaves it in Redis' unacked set until the visibility timeout (hours), and
the filesystem broker loses it. So beat runs this scan every
EXECGO_DEADLINE_SCAN_INTERVAL_S: EXECUTING runs past their deadline (the
partial index ``run_executing_since`` holds only EXECUTING runs) are
settled as their timer would have; one still EXECUTING
EXECGO_DEADLINE_GRACE_S after its deadline, because a step in flight has no
live executor to end it, is forced to TIMEOUT with its unfinished steps
fenced. Each run the scan ends gets a ``deadline_enforced`` audit row,
committed with its ending, and the timeout's own audit row names the scan
as its caller.
"""

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from runs.audit import audit
from runs.closing import fence_unfinished_steps, run_close
from runs.errors import ErrorCode, error_envelope
from runs.models import AuditEvent, Run, TraceKind
from runs.settle import run_settle
from runs.statemachine import RunState
from runs.transitions import InvalidTransitionError, TraceRecord, TransitionLost, lock_run, run_transition

S = RunState
logger = logging.getLogger(__name__)

LAYER = "deadline_scan"
CALLER = "deadline scan"
# The shortest run timeout is 1 s: a run that started executing later cannot be due.
MIN_TIMEOUT = timedelta(seconds=1)


def overdue_runs(now) -> list[Run]:
    """EXECUTING runs whose deadline has passed, oldest first."""
    candidates = (Run.objects.filter(state=S.EXECUTING, executing_started_at__lte=now - MIN_TIMEOUT)
                  .order_by("executing_started_at").only("id", "tenant_id", "state", "executing_started_at",
                                                          "timeout_s"))
    return [run for run in candidates if run.deadline <= now]


def scan_deadlines(now=None) -> list[int]:
    """End every EXECUTING run past its deadline; return the ids ended."""
    now = now or timezone.now()
    ended = []
    for run in overdue_runs(now):
        if deadline_enforce(run, now=now):
            ended.append(run.pk)
    return ended


def deadline_enforce(run: Run, *, now) -> bool:
    """Settle an overdue run as its timer would; force it after the grace.
    False when the run goes on (a step in flight, within the grace) or
    another writer moved it first.

    One transaction, under the run's row lock: the scan's settle or forced
    TIMEOUT, the close and the ``deadline_enforced`` row commit together.
    A run the scan ended is never final without its row (a reader that sees
    it final sees the row; a scan that dies between the two leaves the run
    EXECUTING for the next scan), and a run another writer ended first (its
    timer, a step's result) gets no row of the scan's."""
    late = now - run.deadline
    try:
        with transaction.atomic():
            locked = lock_run(run.pk)
            if locked is None or locked.state != S.EXECUTING:
                return False
            # The timer's own path: TIMEOUT (and closed) unless a step is still running.
            run_settle(run.pk, caller=CALLER)
            forced = Run.objects.filter(pk=run.pk, state=S.EXECUTING).exists()
            if forced:
                if late < timedelta(seconds=settings.EXECGO_DEADLINE_GRACE_S):
                    return False  # the running step's own timeout ends it at the deadline
                _force_timeout(locked, late=late)
                run_close(run.pk)
            audit(AuditEvent.DEADLINE_ENFORCED, run_id=run.pk, tenant_id=run.tenant_id, caller=CALLER,
                  from_state=S.EXECUTING,
                  data={"layer": LAYER, "late_s": round(late.total_seconds(), 3), "forced": forced})
    except (TransitionLost, InvalidTransitionError) as exc:
        logger.info("deadline scan gave up on run %s: %s", run.pk, exc)
        return False
    logger.info("deadline scan ended run %s, %.1fs late (forced: %s)", run.pk, late.total_seconds(), forced)
    return True


def _force_timeout(run: Run, *, late: timedelta) -> None:
    """Under the run's row lock (the caller's) the fence and the edge commit
    together: an attempt still running is superseded, its late result audited."""
    error = error_envelope(ErrorCode.TIMEOUT, f"run exceeded its timeout of {run.timeout_s}s",
                           source="scheduler", details={"timeout_s": run.timeout_s, "layer": LAYER,
                                                        "late_s": round(late.total_seconds(), 3)})
    fence_unfinished_steps(run, reason="run timed out (deadline scan)")
    run_transition(run, S.TIMEOUT, caller=CALLER, expected=S.EXECUTING, message=error["message"],
                   data={"layer": LAYER},
                   trace=TraceRecord(TraceKind.RUN, {"timeout_s": run.timeout_s, "layer": LAYER}, error=error))
