"""The one entry point that writes ``Run.state``, and the run's row lock.

``run_transition`` moves a run along one edge of ``runs.statemachine`` and, in
the same database transaction, stamps the run, appends the Trace and Event
(outbox) rows, writes the AuditLog row and projects ``Job.status``. Run
creation records its first state through the same projector. Nothing leaves
the process before commit.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.utils import timezone
from django_fsm import ConcurrentTransition, TransitionNotAllowed

from runs import recording
from runs.audit import audit, chained
from runs.metrics import count_transition
from runs.models import FINAL_AUDIT_EVENT, AuditEvent, Event, EventType, Job, Run, Step, Trace, TraceKind
from runs.outbox import emit
from runs.statemachine import FINAL, ZOMBIE_SWEEPER, RunState, closing_cause_for, edge, is_legal, job_status_for
from runtime import statements

S = RunState

TRANSITION_FIELDS = ["state", "previous_state", "closing_cause", "last_state_change_at", "executing_started_at",
                     "finished_at"]
# What a decision under the run's lock reads of the run: its context and plan
# are not needed for one. The machine's own columns are, so that a
# transition can move the locked copy as it is (``held``).
RUN_FIELDS = ("id", "tenant_id", "job_id", "state", "previous_state", "closing_cause", "last_state_change_at",
              "finished_at", "cancel_requested_at", "cancel_requested_by_id", "executing_started_at", "timeout_s")


# The whole row but its bulky fields (a stage needing one loads it), for the
# readers of a run on every run's path.
RUN_ROW = tuple(field.attname for field in Run._meta.concrete_fields if field.name not in Run.BULKY_FIELDS)


def lock_run(run_id: int) -> Run | None:
    """The run's row lock. Lock order, everywhere: the run, then its steps."""
    return statements.select_for_update(Run, run_id, RUN_FIELDS)


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


def _method_for(target: str, forced_by: str) -> str:
    if target == S.FAILED and forced_by == ZOMBIE_SWEEPER:
        return "force_failed"
    return f"to_{target.lower()}"


def run_transition(
    run: Run | int,
    target: RunState,
    *,
    caller: str | None = None,
    actor: Any = None,
    forced_by: str = "",
    message: str = "",
    data: dict[str, Any] | None = None,
    trace: TraceRecord | None = None,
    expected: str | None = None,
    held: bool = False,
) -> Run:
    """Move ``run`` to ``target``; return the saved run.

    ``caller`` defaults to who the table says triggers the edge. ``expected``
    is the state the caller decided on; when the run has moved on since, the
    attempt is audited and ``TransitionLost`` raised, as it is when a
    concurrent writer wins the optimistic lock. Raises
    ``InvalidTransitionError`` for an edge that is not legal from the run's
    current state. ``held``: ``run`` is an instance read, or saved by a
    transition, in the caller's transaction after it took the run's row
    lock (SQLite: its write lock), so it is current and is moved as it is,
    not read again; or one read in a state of ``ENTERED_ONCE``, which is
    stale only if the run has moved on (the UPDATE, filtered on the state
    read, then changes nothing and the transition is lost).
    """
    run_id = run if isinstance(run, int) else run.pk
    data = data or {}
    attempt = _Attempt(source=expected or "", caller=caller)
    try:
        # Inside the caller's transaction no savepoint: ``_move`` raises
        # every refusal and every lost race before it writes anything (the
        # run's UPDATE, filtered on the state it read, is its first write and
        # its last check), so the caller's transaction is left as it was.
        with statements.in_transaction():
            current = run if held and isinstance(run, Run) else None
            return _move(run_id, target, attempt, current=current, expected=expected, actor=actor,
                         forced_by=forced_by, message=message, data=data, trace=trace)
    except InvalidTransitionError as exc:
        audit(AuditEvent.INVALID_TRANSITION, run_id=run_id, tenant_id=_tenant_of(run_id), actor=actor,
              caller=exc.caller, forced_by=forced_by, from_state=exc.source, to_state=target, data=data,
              independently=True)
        raise
    except ConcurrentTransition:
        current = Run.objects.filter(pk=run_id).values_list("state", flat=True).first() or ""
        wanted_from = expected or attempt.source
        audit(AuditEvent.TRANSITION_LOST, run_id=run_id, tenant_id=_tenant_of(run_id), actor=actor,
              caller=attempt.caller or "unknown", forced_by=forced_by, from_state=wanted_from, to_state=target,
              data={**data, "current_state": current}, independently=True)
        raise TransitionLost(run_id, wanted_from, target, current) from None


@dataclass
class _Attempt:
    """What a transition attempt learnt before it failed: the state it
    found and who it was made for (the audit row of a lost race names both)."""

    source: str
    caller: str | None


def _move(run_id: int, target: RunState, attempt: _Attempt, *, current: Run | None, expected: str | None,
          actor: Any, forced_by: str, message: str, data: dict[str, Any], trace: TraceRecord | None) -> Run:
    """``run_transition`` inside its transaction: check the edge, stamp and
    save the run (``current``, the caller's up-to-date copy, else read),
    write its traces and project the new state."""
    run = current if current is not None else Run.objects.defer(*Run.BULKY_FIELDS).get(pk=run_id)
    source = attempt.source = run.state
    if attempt.caller is None:
        found = edge(source, target)
        attempt.caller = found.triggered_by if found else "unknown"
    caller = attempt.caller
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
    # Only the machine's own columns (a full save would write back a cancel
    # request stored by another transaction since our read), and only if the
    # run is still in the state read: django-fsm's optimistic lock, without
    # ``save()``, which would mark the caller's transaction for rollback when
    # the lock fails. Compiled once (``transition``: this is the state's
    # transition service).
    if not statements.update(Run, {"id": run_id, "state": source},
                             {name: getattr(run, name) for name in TRANSITION_FIELDS}, transition=True):
        raise ConcurrentTransition(f"expected {source}, the run has moved on")
    run._update_initial_state()  # as save() does: a later save of this copy expects the new state

    transition_data = {"caller": caller, **({"forced_by": forced_by} if forced_by else {}), **data}
    traces = [Trace(run=run, kind=TraceKind.TRANSITION, from_state=source, to_state=target, data=transition_data)]
    if trace is not None:
        traces.append(Trace(run=run, kind=trace.kind, from_state=source, to_state=target, step=trace.step,
                            data=trace.data, error=trace.error))
    held = recording.held()
    if held is not None:
        held.traces.extend(traces)
    else:
        statements.insert(traces)
    record_state(run, source, target, now, event=FINAL_AUDIT_EVENT.get(target, AuditEvent.STATE_CHANGED),
                 caller=caller, actor=actor, forced_by=forced_by, message=message or f"{source} → {target}",
                 data=data)
    return run


def record_state(run: Run, source: str | None, target: str, now: datetime, *, event: AuditEvent, caller: str,
                 actor: Any = None, forced_by: str = "", message: str, data: dict[str, Any]) -> None:
    """The projector: the Event (outbox) row, the AuditLog row and the Job
    projection of ``run`` entering ``target`` (from ``source``; None when
    the run was just created), in the caller's transaction."""
    emit([Event(
        type=EventType.RUN_STATE_CHANGED, run=run, timestamp=now, message=message,
        data={"from": source, "to": target, "closing_cause": run.closing_cause},
    )])
    audit(event, run_id=run.pk, tenant_id=run.tenant_id, actor=actor, caller=caller, forced_by=forced_by,
          from_state=source or "", to_state=target, data=data)
    count_transition(source, target)
    # The projection follows the job's latest run only: an older run of the
    # same job is final and can no longer move, but never let it overwrite.
    projection = {
        "status": job_status_for(target),
        "run_state_snapshot": {
            "run_id": run.pk, "state": target, "closing_cause": run.closing_cause,
            "last_state_change_at": now.isoformat(),
        },
        "updated_at": now,
    }
    held = recording.held()
    if held is not None:
        held.jobs[(run.job_id, run.pk)] = projection
    else:
        statements.update(Job, {"id": run.job_id, "latest_run_id": run.pk}, projection)


@contextmanager
def recorded_at_the_end() -> Iterator[None]:
    """What the block records (events, traces, audit rows, job
    projections: ``runs.recording``) is held and written together as it
    ends without an error, in the caller's transaction, which the block
    must end with, just before its commit. Inside another such block, the
    outer one writes it."""
    if recording.held() is not None:
        yield
        return
    with recording.holding() as held:
        yield
    write_held(held)


def write_held(held: recording.Held | None = None) -> None:
    """Write what the ``recorded_at_the_end`` block holds (``held``, else
    the one this code runs in) now, in two round trips on PostgreSQL: the
    audit rows' chain heads, then every row and projection. For a reader
    of those rows inside the block; the block holds what follows."""
    held = held if held is not None else recording.held()
    if not held:
        return
    rows = held.taken()
    heads = chained(rows.audit_rows, using="default")
    projections = [(Job, {"id": job_id, "latest_run_id": run_id}, values)
                   for (job_id, run_id), values in rows.jobs.items()]
    statements.write_together([rows.traces, rows.events, rows.audit_rows], [*projections, *heads])


def _tenant_of(run_id: int) -> int | None:
    return Run.objects.filter(pk=run_id).values_list("tenant_id", flat=True).first()
