"""The one entry point that writes ``Run.state``.

``run_transition`` moves a run along one edge of ``runs.statemachine`` and, in
the same database transaction, stamps the run, appends the Trace and Event
(outbox) rows, writes the AuditLog row and projects ``Job.status``. Nothing
leaves the process before commit.
"""

from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone
from django_fsm import ConcurrentTransition, TransitionNotAllowed

from execgo import statements
from runs.models import AuditLog, Event, EventType, Job, Run, Step, Trace, TraceKind
from runs.statemachine import (
    FINAL,
    ZOMBIE_SWEEPER,
    RunState,
    closing_cause_for,
    is_legal,
    job_status_for,
)

S = RunState

FINAL_AUDIT_EVENT = {
    S.SUCCEEDED: "run_succeeded",
    S.CLOSED_REJECTED: "run_rejected",
    S.CLOSED_FAILED: "run_failed",
    S.CLOSED_CANCELLED: "run_cancelled",
}


TRANSITION_FIELDS = ["state", "previous_state", "closing_cause", "last_state_change_at", "executing_started_at",
                     "finished_at"]


class InvalidTransitionError(Exception):
    """An attempt to move a run along an edge that is not in the table."""

    def __init__(self, run_id: int, source: str, target: str, caller: str) -> None:
        super().__init__(f"run {run_id}: {source} → {target} is not a legal transition (caller: {caller})")
        self.run_id = run_id
        self.source = source
        self.target = target
        self.caller = caller


class TransitionLost(Exception):
    """Another writer moved the run first; the attempt was audited, not applied."""

    def __init__(self, run_id: int, expected: str, target: str, current: str) -> None:
        super().__init__(f"run {run_id}: wanted {expected} → {target}, but it is already {current}")
        self.run_id = run_id
        self.expected = expected
        self.target = target
        self.current = current


@dataclass
class TraceRecord:
    """An extra trace the caller wants committed with the transition
    (a PolicyDecisionTrace, a HITLDecisionTrace, a RunTrace, …)."""

    kind: str
    data: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    step: Step | None = None


def audit_independently(**fields: Any) -> AuditLog:
    """Write an AuditLog row that survives the rollback of the caller's
    transaction.

    On PostgreSQL the row goes through the second ("audit") connection, which
    commits on its own. SQLite has a single writer and the caller's open
    transaction holds it, so there the row can only ride with that
    transaction; outside a transaction both commit immediately anyway.
    """
    alias = "audit" if connection.in_atomic_block and not settings.IS_SQLITE else "default"
    return AuditLog.objects.using(alias).create(**fields)


def _method_for(target: str, forced_by: str) -> str:
    if target == S.FAILED and forced_by == ZOMBIE_SWEEPER:
        return "force_failed"
    return f"to_{target.lower()}"


def run_transition(
    run: Run | int,
    target: RunState,
    *,
    caller: str,
    actor: Any = None,
    forced_by: str = "",
    message: str = "",
    data: dict[str, Any] | None = None,
    trace: TraceRecord | None = None,
    audit_event: str = "",
    expected: str | None = None,
) -> Run:
    """Move ``run`` to ``target``; return the saved run.

    ``expected`` is the state the caller decided on; when the run has moved
    on since, the attempt is audited and ``TransitionLost`` raised, as it is
    when a concurrent writer wins the optimistic lock. Raises
    ``InvalidTransitionError`` for an edge that is not legal from the run's
    current state.
    """
    run_id = run if isinstance(run, int) else run.pk
    data = data or {}
    source = expected or ""
    try:
        with transaction.atomic():
            run = Run.objects.defer(*Run.BULKY_FIELDS).get(pk=run_id)
            source = run.state
            if expected is not None and source != expected:
                raise ConcurrentTransition(f"expected {expected}, found {source}")
            if not is_legal(source, target, closing_cause=run.closing_cause, forced_by=forced_by):
                raise InvalidTransitionError(run_id, source, target, caller)
            try:
                getattr(run, _method_for(target, forced_by))()
            except TransitionNotAllowed:
                raise InvalidTransitionError(run_id, source, target, caller) from None

            now = timezone.now()
            if target == S.TRACING:
                run.closing_cause = closing_cause_for(source, run.previous_state)
            if target == S.EXECUTING and run.executing_started_at is None:
                run.executing_started_at = now
            if target in FINAL:
                run.finished_at = now
            run.previous_state = source
            run.last_state_change_at = now
            # Only the machine's own columns: a full save would write back a
            # cancel request stored by another transaction since our read.
            run.save(update_fields=TRANSITION_FIELDS)

            _record(run, source, target, now, caller=caller, actor=actor, forced_by=forced_by,
                    message=message, data=data, trace=trace, audit_event=audit_event)
            return run
    except InvalidTransitionError as exc:
        audit_independently(
            run_id=run_id, tenant_id=_tenant_of(run_id), event="invalid_transition", actor=_user_or_none(actor),
            caller=caller, forced_by=forced_by, from_state=exc.source, to_state=target, data=data,
        )
        raise
    except ConcurrentTransition:
        current = Run.objects.filter(pk=run_id).values_list("state", flat=True).first() or ""
        wanted_from = expected or source
        audit_independently(
            run_id=run_id, tenant_id=_tenant_of(run_id), event="transition_lost", actor=_user_or_none(actor),
            caller=caller, forced_by=forced_by, from_state=wanted_from, to_state=target,
            data={**data, "current_state": current},
        )
        raise TransitionLost(run_id, wanted_from, target, current) from None


def _record(run: Run, source: str, target: str, now, *, caller, actor, forced_by, message, data, trace, audit_event):
    transition_data = {"caller": caller, **({"forced_by": forced_by} if forced_by else {}), **data}
    traces = [
        Trace(run=run, kind=TraceKind.TRANSITION, from_state=source, to_state=target, data=transition_data)
    ]
    if trace is not None:
        traces.append(Trace(run=run, kind=trace.kind, from_state=source, to_state=target, step=trace.step,
                            data=trace.data, error=trace.error))
    # Every transition writes these four: compiled statements (see execgo/statements.py).
    statements.insert(traces)
    statements.insert([Event(
        type=EventType.RUN_STATE_CHANGED, run=run, timestamp=now, message=message or f"{source} → {target}",
        data={"from": source, "to": target, "closing_cause": run.closing_cause},
    )])
    statements.insert([AuditLog(
        run=run, tenant_id=run.tenant_id, event=audit_event or FINAL_AUDIT_EVENT.get(target, "state_changed"),
        actor=_user_or_none(actor), caller=caller, forced_by=forced_by, from_state=source, to_state=target,
        data=data,
    )])
    # The projection follows the job's latest run only: an older run of the
    # same job is final and can no longer move, but never let it overwrite.
    statements.update(Job, {"id": run.job_id, "latest_run_id": run.pk}, {
        "status": job_status_for(target),
        "run_state_snapshot": {
            "run_id": run.pk, "state": target, "closing_cause": run.closing_cause,
            "last_state_change_at": now.isoformat(),
        },
        "updated_at": now,
    })


def _user_or_none(actor: Any):
    return actor if getattr(actor, "is_authenticated", False) else None


def _tenant_of(run_id: int) -> int | None:
    return Run.objects.filter(pk=run_id).values_list("tenant_id", flat=True).first()
