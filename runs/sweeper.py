"""The zombie sweeper (docs/sweeper.md): the fallback for runs nobody drives.

A run that waits on a worker (CREATED, PREPARING, PLANNING, POLICY_CHECK,
TRACING and the transient states) past its state's threshold most likely
had its message lost: a broker restarted empty, a worker killed holding
it. Its work is sent again, up to ``EXECGO_SWEEP_RESENDS`` times, each
after another threshold of no progress (every task is safe to deliver
twice); an EXECUTING run with no step running is sent its queued steps
again the same way. A run still stuck once its re-sends are spent, and an
EXECUTING or AWAITING_HITL run past its own timeout, is forced along a
legal path to a final state, through the same transition service (and
optimistic lock) as everyone else; the error says which of the two it was.
"""

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import DurationField, Exists, F, Func, OuterRef, Q, QuerySet, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from approvals import interface as approvals
from runs.audit import audit
from runs.closing import fence_unfinished_steps, run_close
from runs.dataplane import queue_for
from runs.dispatch import Claim, enqueue_advance, enqueue_claims, enqueue_sweeps
from runs.errors import ErrorCode, error_envelope
from runs.models import AuditEvent, Run, Step, StepRunStatus, TraceKind
from runs.statemachine import FINAL, TRANSIENT, ZOMBIE_SWEEPER, RunState
from runs.transitions import InvalidTransitionError, TraceRecord, TransitionLost, lock_run, run_transition

S = RunState
logger = logging.getLogger(__name__)

# state → the edge the sweeper forces out of it
FORCED_EDGE = {
    S.CREATED: S.FAILED,
    S.PREPARING: S.FAILED,
    S.PLANNING: S.TIMEOUT,
    S.POLICY_CHECK: S.FAILED,
    S.AWAITING_HITL: S.TIMEOUT,
    S.EXECUTING: S.TIMEOUT,
    S.TRACING: S.FAILED,
}


def threshold_for(run: Run) -> timedelta:
    """How long ``run`` may stay in its current state."""
    if run.state == S.AWAITING_HITL:
        return timedelta(seconds=run.approval_timeout_s)
    if run.state == S.EXECUTING:
        return timedelta(seconds=run.timeout_s)
    if run.state in TRANSIENT:
        return timedelta(seconds=settings.EXECGO_ZOMBIE_THRESHOLDS_S["TRANSIENT"])
    return timedelta(seconds=settings.EXECGO_ZOMBIE_THRESHOLDS_S[run.state])


# The states whose work a worker does unasked: a run stuck there is sent it again first.
RESENDABLE = frozenset({S.CREATED, S.PREPARING, S.PLANNING, S.POLICY_CHECK, S.TRACING, *TRANSIENT})


def _stuck_since(run: Run):
    # EXECUTING is bounded by the run's total time, not by its last change.
    if run.state == S.EXECUTING and run.executing_started_at is not None:
        return run.executing_started_at
    if run.state in RESENDABLE and run.resent_at is not None:
        return max(run.last_state_change_at, run.resent_at)  # each re-send gets a threshold of its own
    return run.last_state_change_at


def _resends_left(run: Run) -> bool:
    return run.state in RESENDABLE and run.resends < settings.EXECGO_SWEEP_RESENDS


class Seconds(Func):
    """An integer column of seconds as a duration (Django's own arithmetic
    cannot multiply a duration on SQLite, which stores it in microseconds)."""

    output_field = DurationField()

    def as_postgresql(self, compiler, connection, **extra):
        return self.as_sql(compiler, connection, template="make_interval(secs => %(expressions)s)", **extra)

    def as_sqlite(self, compiler, connection, **extra):
        return self.as_sql(compiler, connection, template="(%(expressions)s * 1000000)", **extra)


def stuck_candidates(now) -> QuerySet:
    """The runs past their state's threshold, as one query: a range scan per
    state of the partial index on non-final runs (state,
    last_state_change_at), whose predicate the ``exclude`` repeats, so the
    final runs (nearly all of the table) are never read, and the live runs
    of EXECUTING and AWAITING_HITL are judged by their own timeouts in SQL
    rather than loaded. ``threshold_for`` stays the judge of each row."""
    stuck = Q(state=S.AWAITING_HITL, last_state_change_at__lt=Value(now) - Seconds("approval_timeout_s"))
    stuck |= Q(state=S.EXECUTING, stuck_since__lt=Value(now) - Seconds("timeout_s"))
    for state in (S.CREATED, S.PREPARING, S.PLANNING, S.POLICY_CHECK, S.TRACING):
        stuck |= Q(state=state, last_state_change_at__lt=now - timedelta(
            seconds=settings.EXECGO_ZOMBIE_THRESHOLDS_S[state]))
    stuck |= Q(state__in=sorted(TRANSIENT), last_state_change_at__lt=now - timedelta(
        seconds=settings.EXECGO_ZOMBIE_THRESHOLDS_S["TRANSIENT"]))
    return (Run.objects.exclude(state__in=sorted(FINAL))
            .alias(stuck_since=Coalesce("executing_started_at", "last_state_change_at"))
            .filter(stuck).defer(*Run.BULKY_FIELDS).order_by("pk"))


def sweep_zombies(now=None, *, inline_max: int | None = None) -> list[int]:
    """Force every stuck run to a final state; return the ids recovered.

    ``inline_max``: when more runs than that are stuck, they are handed to
    the workers instead, one ``sweep_stuck_run`` task each (closing a run
    takes several transactions: a thousand at once would hold this task for
    many seconds, where the workers close them side by side), and the ids
    handed over are returned. None: close them all here."""
    now = now or timezone.now()
    resend_stalled_executions(now)
    stuck = [run for run in stuck_candidates(now) if now - _stuck_since(run) > threshold_for(run)]
    resent = [run for run in stuck if _resends_left(run)]
    for run in resent:
        resend_run_work(run, age=now - _stuck_since(run))
    stuck = [run for run in stuck if not _resends_left(run)]
    if inline_max is not None and len(stuck) > inline_max:
        with transaction.atomic():
            enqueue_sweeps([run.pk for run in stuck])
        return [run.pk for run in stuck]
    return [run.pk for run in stuck if sweep_run(run, age=now - _stuck_since(run))]


def sweep_one(run_id: int) -> bool:
    """The worker's side of a handed-over sweep: close the run if it is
    still stuck when the task runs (another writer may have moved it)."""
    now = timezone.now()
    run = stuck_candidates(now).filter(pk=run_id).first()
    if run is None or now - _stuck_since(run) <= threshold_for(run):
        return False
    if _resends_left(run):
        return resend_run_work(run, age=now - _stuck_since(run))
    return sweep_run(run, age=now - _stuck_since(run))


def resend_run_work(run: Run, *, age: timedelta) -> bool:
    """Send a stuck run's work again (its driving task; ``steps``: the
    attempts of an EXECUTING run that were queued and never taken).
    Counted on the run, under a compare-and-set on that count, so two
    sweepers send it once. False when another writer got there first."""
    now = timezone.now()
    with transaction.atomic():
        taken = Run.objects.filter(pk=run.pk, state=run.state, resends=run.resends).update(
            resends=F("resends") + 1, resent_at=now)
        if not taken:
            return False
        queued = []
        if run.state == S.EXECUTING:
            queued = list(Step.objects.filter(run_id=run.pk, run_status=StepRunStatus.ACCEPTED)
                          .only("pk", "step_id", "attempt", "tool", "requested_plan", "rated_plan"))
            enqueue_claims([Claim(step.pk, step.attempt, queue_for(step)) for step in queued])
        enqueue_advance(run.pk, durable=True)
        audit(AuditEvent.WORK_RESENT, run_id=run.pk, tenant_id=run.tenant_id, caller="zombie sweeper",
              forced_by=ZOMBIE_SWEEPER, from_state=run.state,
              data={"resends": run.resends + 1, "of": settings.EXECGO_SWEEP_RESENDS,
                    "age_s": round(age.total_seconds(), 3), "steps": [step.step_id for step in queued]})
    logger.info("run %s stuck in %s for %ss: its work sent again (%d of %d)", run.pk, run.state,
                int(age.total_seconds()), run.resends + 1, settings.EXECGO_SWEEP_RESENDS)
    return True


def resend_stalled_executions(now) -> list[int]:
    """EXECUTING runs with no step running and none of their work moving
    for ``EXECGO_ZOMBIE_THRESHOLDS_S["EXECUTING_IDLE"]``: the messages of
    their queued steps (or the one that dispatches them) were most likely
    lost. Each is sent again, within the run's re-sends; its deadline stays
    the bound (the deadline scan and the sweeper's EXECUTING row)."""
    quiet = now - timedelta(seconds=settings.EXECGO_ZOMBIE_THRESHOLDS_S["EXECUTING_IDLE"])
    running = Step.objects.filter(run_id=OuterRef("pk"), run_status=StepRunStatus.RUNNING)
    stalled = (Run.objects.filter(state=S.EXECUTING, resends__lt=settings.EXECGO_SWEEP_RESENDS)
               .alias(since=Coalesce("executing_started_at", "last_state_change_at"))
               .filter(since__lt=quiet, since__gt=Value(now) - Seconds("timeout_s"))  # not yet past its deadline
               .filter(Q(resent_at__isnull=True) | Q(resent_at__lt=quiet))
               .exclude(Exists(running)).defer(*Run.BULKY_FIELDS).order_by("pk"))
    return [run.pk for run in stalled if resend_run_work(run, age=now - (run.resent_at or _stuck_since(run)))]


def sweep_run(run: Run, *, age: timedelta) -> bool:
    """Close one stuck run. False when another writer moved it first."""
    stuck_in = run.state
    audit(AuditEvent.ZOMBIE_DETECTED, run_id=run.pk, tenant_id=run.tenant_id, caller="zombie sweeper",
          forced_by=ZOMBIE_SWEEPER, from_state=stuck_in, data={"age_s": round(age.total_seconds(), 3)})
    try:
        if stuck_in not in TRANSIENT:
            target = FORCED_EDGE[stuck_in]
            code = ErrorCode.TIMEOUT if target == S.TIMEOUT else ErrorCode.INTERNAL
            why = (f"its work sent again {run.resends} times with no progress" if stuck_in in RESENDABLE else
                   "past its timeout")
            error = error_envelope(code, f"run stuck in {stuck_in} for {int(age.total_seconds())}s: {why}",
                                   source="scheduler", details={"layer": "sweeper", "stuck_in": stuck_in,
                                                                "resends": run.resends,
                                                                "bound": "resends" if stuck_in in RESENDABLE
                                                                else "timeout"})
            # An approval that expired is a decision by default (reject), traced as such.
            kind, data = TraceKind.RUN, {"layer": "sweeper", "stuck_in": stuck_in}
            if stuck_in == S.AWAITING_HITL:
                kind, data = TraceKind.HITL_DECISION, {**data, "decision": "reject", "timeout": True}
            transition = {"caller": "zombie sweeper", "forced_by": ZOMBIE_SWEEPER, "expected": stuck_in,
                          "message": error["message"], "data": {"layer": "sweeper"},
                          "trace": TraceRecord(kind, data, error=error)}
            with transaction.atomic():
                # The row lock keeps every other writer out, so the fence and the
                # transition commit together or not at all: attempts still running
                # are superseded from this moment, their late results audited.
                locked = lock_run(run.pk)
                still_stuck = locked is not None and locked.state == stuck_in
                if still_stuck:
                    fence_unfinished_steps(run, reason=f"run forced from {stuck_in} to {target} "
                                                       "by the zombie sweeper")
                    run_transition(run, target, **transition)
                    if stuck_in == S.AWAITING_HITL:  # the expiry's message was lost: this is the fallback
                        expired = approvals.close_pending(run.pk, approvals.ApprovalStatus.EXPIRED,
                                                          now=timezone.now(),
                                                          reason="expired with no decision (sweeper)")
                        for request in expired:
                            audit(AuditEvent.HITL_TIMEOUT, run_id=run.pk, tenant_id=run.tenant_id,
                                  caller="zombie sweeper", forced_by=ZOMBIE_SWEEPER, from_state=stuck_in,
                                  data={"request": request.pk, "expires_at": request.expires_at.isoformat()})
            if not still_stuck:
                run_transition(run, target, **transition)  # raises TransitionLost, audited as any lost race
        closed = run_close(run.pk)
    except (TransitionLost, InvalidTransitionError) as exc:
        logger.info("sweeper gave up on run %s: %s", run.pk, exc)
        return False
    audit(AuditEvent.ZOMBIE_RECOVERED, run_id=run.pk, tenant_id=run.tenant_id, caller="zombie sweeper",
          forced_by=ZOMBIE_SWEEPER, from_state=stuck_in, to_state=closed.state if closed else "")
    return True
