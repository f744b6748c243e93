"""Closing a run: from a transient state through TRACING to its final state.

Every ending passes here (docs/stages.md#tracing-and-closing): the settle
that sees a run's last step finish, the stages that fail, the sweeper, a
decision on an approval and a cancel of a run waiting for one. Closing fences
the steps still pending or in flight, so a late result finds its fence gone
and is audited, not applied.
"""

from django.db import transaction
from django.utils import timezone

from approvals import interface as approvals
from runs.audit import audit
from runs.errors import ErrorCode, error_envelope
from runs.memory import memory_write
from runs.models import AuditEvent, EventType, Run, Step, StepRunStatus, StepStatus, TraceKind
from runs.outbox import emit_step_event
from runs.statemachine import FINAL_STATE_FOR_CAUSE, TRANSIENT, RunState
from runs.step_lifecycle import IN_FLIGHT, step_set
from runs.steps import skip_pending, unstarted_result
from runs.transitions import (
    RUN_ROW,
    TraceRecord,
    TransitionLost,
    recorded_at_the_end,
    run_transition,
    write_held,
)
from runs.webhooks import run_callback_payload, webhook_configured, webhook_notify
from runtime import statements

S = RunState


def run_close(run_id: int, *, tracing: Run | None = None) -> Run | None:
    """Take a run from a transient state through TRACING to its final state.

    The RunTrace summary and the final AuditLog event commit with the final
    transition. If writing them fails the run stays in TRACING, where the
    sweeper finds it; it never skips to a final state.

    ``tracing``: the run as the caller's transaction, just committed, moved
    it to TRACING (a settle that ended its execution); it spares the read
    that decides where the close starts. Whether the run is still there is
    known under its row lock, as for any caller.
    """
    if tracing is not None and tracing.pk == run_id and tracing.state == S.TRACING:
        run = tracing
    else:
        run = statements.select(Run, run_id, RUN_ROW)
    if run is None or run.is_final:
        return run
    if run.state in TRANSIENT:
        run = run_transition(run, S.TRACING, expected=run.state)
    if run.state != S.TRACING:
        return run
    target = FINAL_STATE_FOR_CAUSE[run.closing_cause]
    with transaction.atomic(), recorded_at_the_end():
        # Read under the run's row lock (before the steps', as everywhere),
        # which run_cancel takes too: the cancel request as it finally
        # stands, and a copy the final transition moves as it is.
        run = statements.select_for_update(Run, run_id, RUN_ROW)
        cancel_superseded = run.cancel_requested_at is not None and target != S.CLOSED_CANCELLED
        steps = list(run.steps.order_by("position").only(*CLOSE_STEP_FIELDS))
        fence_unfinished_steps(run, reason=f"run closed as {target}", steps=steps)
        run = run_transition(
            run, target, expected=S.TRACING, held=True,
            actor=run.cancel_requested_by if target == S.CLOSED_CANCELLED else None,
            trace=TraceRecord(TraceKind.RUN, _run_summary(run, steps)),
        )
        if target == S.SUCCEEDED:
            memory_write(run, steps)
        if run.callback_url and "final" in run.callback_events and webhook_configured(run.callback_url):
            webhook_notify("run.final", run_callback_payload(run), url=run.callback_url, run_id=run.pk,
                           tenant_id=run.tenant_id)
        if cancel_superseded:
            # A cancel that arrived too late to apply is answered, not dropped
            # (``run`` is the copy read under the lock).
            audit(AuditEvent.CANCEL_SUPERSEDED, run_id=run.pk, tenant_id=run.tenant_id,
                  actor=run.cancel_requested_by, caller="tracer", to_state=target)
    return run


# What closing reads of each step, once: what fencing an unfinished one
# writes and its events name, the summary's fields and the results the
# memory keeps (not the step's parameters and plans).
CLOSE_STEP_FIELDS = ("id", "run_id", "step_id", "position", "tool", "status", "run_status", "attempt", "handle_id",
                     "started_at", "result")


def run_cancel_awaiting_approval(run_id: int) -> Run | None:
    """Apply a stored cancel request to a run waiting for approval: CANCELLED,
    then closed. None when an approval, the expiry or the sweeper moved the
    run first (the request then applies wherever the run went)."""
    run = Run.objects.select_related("cancel_requested_by").get(pk=run_id)
    try:
        with transaction.atomic():
            run_transition(run, S.CANCELLED, actor=run.cancel_requested_by, expected=S.AWAITING_HITL)
            approvals.close_pending(run_id, approvals.ApprovalStatus.CANCELLED, reason="the run was cancelled",
                                    now=timezone.now())
        return run_close(run_id)
    except TransitionLost:
        return None


def fence_unfinished_steps(run: Run, *, reason: str, steps: list[Step] | None = None) -> None:
    """When a run closes with steps still pending or in flight (the sweeper
    or a timeout closed it under a slow worker), skip the pending ones and
    end the in-flight attempts here, so that a late result of theirs finds
    its fence gone and is audited instead of applied. ``steps``: the run's
    steps, read under its lock (else read here); those fenced are updated."""
    ended = (StepStatus.SUCCESS, StepStatus.FAILED, StepStatus.SKIPPED)
    if steps is None:
        steps = list(run.steps.exclude(status__in=ended))
    else:
        steps = [step for step in steps if step.status not in ended]
    skip_pending(run, steps, reason)
    for step in steps:
        if step.run_status in IN_FLIGHT and step_set(
            step, expect=(step.status, step.run_status), to=(StepStatus.FAILED, StepRunStatus.CANCELLED),
            where={"attempt": step.attempt}, finished_at=timezone.now(),
            result=unstarted_result(step, step.attempt, step.started_at or timezone.now(),
                                    error_envelope(ErrorCode.CANCELLED, reason, source="scheduler")),
        ):
            emit_step_event(run.pk, step, EventType.TASK_CANCELLED, reason, {"attempt": step.attempt})


def _run_summary(run: Run, steps: list[Step]) -> dict:
    write_held()  # the traces this transaction has recorded so far, read below
    traces = list(run.traces.filter(kind__in=(TraceKind.TRANSITION, TraceKind.POLICY_DECISION,
                                              TraceKind.HITL_DECISION))
                  .values_list("kind", "to_state", "created_at", "id"))  # in order (Trace.Meta.ordering)
    transitions = [(state, at) for kind, state, at, _id in traces if kind == TraceKind.TRANSITION]
    stages = {}
    for (state, entered), (_next, left) in zip(transitions, transitions[1:]):
        stages[state] = round((left - entered).total_seconds() * 1000, 3)
    steps = [{"step_id": step.step_id, "status": step.status, "attempt": step.attempt} for step in steps]
    return {
        "closing_cause": run.closing_cause,
        "stage_ms": stages,
        "total_ms": round((timezone.now() - run.created_at).total_seconds() * 1000, 3),
        "steps": steps,
        "attempts": sum(step["attempt"] for step in steps),
        "policy_traces": [pk for kind, _state, _at, pk in traces if kind == TraceKind.POLICY_DECISION],
        "hitl_traces": [pk for kind, _state, _at, pk in traces if kind == TraceKind.HITL_DECISION],
    }
