"""The zombie sweeper (SPEC §6): the fallback that closes runs nobody drives.

Every run whose time in its current state exceeds the threshold for that
state is forced along a legal path to a final state, through the same
transition service (and optimistic lock) as everyone else.
"""

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import DurationField, Func, Q, QuerySet, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from approvals.models import ApprovalRequest, ApprovalStatus
from runs.audit import audit
from runs.closing import fence_unfinished_steps, run_close
from runs.dispatch import enqueue_sweeps
from runs.errors import ErrorCode, error_envelope
from runs.models import AuditEvent, Run, TraceKind
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


def _stuck_since(run: Run):
    # EXECUTING is bounded by the run's total time, not by its last change.
    if run.state == S.EXECUTING and run.executing_started_at is not None:
        return run.executing_started_at
    return run.last_state_change_at


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
    stuck = [run for run in stuck_candidates(now) if now - _stuck_since(run) > threshold_for(run)]
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
    return sweep_run(run, age=now - _stuck_since(run))


def sweep_run(run: Run, *, age: timedelta) -> bool:
    """Close one stuck run. False when another writer moved it first."""
    stuck_in = run.state
    audit(AuditEvent.ZOMBIE_DETECTED, run_id=run.pk, tenant_id=run.tenant_id, caller="zombie sweeper",
          forced_by=ZOMBIE_SWEEPER, from_state=stuck_in, data={"age_s": round(age.total_seconds(), 3)})
    try:
        if stuck_in not in TRANSIENT:
            target = FORCED_EDGE[stuck_in]
            code = ErrorCode.TIMEOUT if target == S.TIMEOUT else ErrorCode.INTERNAL
            error = error_envelope(code, f"run stuck in {stuck_in} for {int(age.total_seconds())}s",
                                   source="scheduler", details={"layer": "sweeper", "stuck_in": stuck_in})
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
                        expired = ApprovalRequest.close_pending(run.pk, ApprovalStatus.EXPIRED, now=timezone.now(),
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
