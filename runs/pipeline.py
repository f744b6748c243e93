"""The harness stages that drive a run from CREATED to a final state.

Each stage does its work and takes exactly one edge of the state machine;
a failure takes the failure edge, never "stays". Every stage re-reads the
run, so a duplicate delivery of the driving task, or a second worker, finds
the run moved on and stops (the transition's optimistic lock decides).
"""

import logging

from django.db import transaction
from django.utils import timezone

from runs.context import assemble_context
from runs.errors import ExecGoError
from runs.execution import Claim, executing_started, fence_unfinished_steps, lock_run, run_settle
from runs.memory import memory_write
from runs.models import AuditLog, Event, EventType, Run, Step, TraceKind
from runs.planners import PlanningFailed, plan_run
from runs.policy import evaluate_policy
from runs.statemachine import FINAL_STATE_FOR_CAUSE, TRANSIENT, RunState
from runs.transitions import TraceRecord, TransitionLost, run_transition

S = RunState
logger = logging.getLogger(__name__)


def run_advance(run_id: int) -> Claim | None:
    """Drive the run as far as it can go without outside input; once it is
    EXECUTING, dispatch its first steps and hand one back to run in-process."""
    while True:
        run = Run.objects.defer(*Run.BULKY_FIELDS).filter(pk=run_id).first()  # the stage needing them loads them
        if run is None or run.is_final:
            return None
        if run.state == S.EXECUTING:
            executing_started(run)
            return run_settle(run_id, claim_one=True)
        if run.state == S.AWAITING_HITL and run.cancel_requested_at is not None:
            # A cancel requested before the run reached its first state with a
            # CANCELLED edge is applied here, not left for the approver.
            run_cancel_awaiting_approval(run_id)
            return None
        stage = STAGES.get(run.state)
        if stage is None:  # AWAITING_HITL: a human or the expiry moves it
            return None
        try:
            stage(run)
        except TransitionLost as lost:
            logger.info("run %s: %s; another writer drives it", run_id, lost)
            return None


def _prepare(run: Run) -> None:
    try:
        assembled = assemble_context(run)
    except ExecGoError as exc:
        run_transition(run, S.FAILED, caller="context assembler", expected=S.PREPARING,
                       message=exc.envelope["message"],
                       trace=TraceRecord(TraceKind.MEMORY_RETRIEVE, exc.envelope["details"], error=exc.envelope))
        return
    with transaction.atomic():
        Run.objects.filter(pk=run.pk).update(context=assembled.context)
        run_transition(run, S.PLANNING, caller="context assembler", expected=S.PREPARING,
                       trace=TraceRecord(TraceKind.MEMORY_RETRIEVE, assembled.trace))


def _plan(run: Run) -> None:
    try:
        steps, trace_data = plan_run(run)
    except PlanningFailed as failure:
        run_transition(run, S.TIMEOUT if failure.timed_out else S.FAILED, caller="planner", expected=S.PLANNING,
                       message=failure.envelope["message"],
                       trace=TraceRecord(TraceKind.TOOL_INVOCATION, {"tool": "planner", **failure.trace_data},
                                         error=failure.envelope))
        return
    now = timezone.now()
    with transaction.atomic():
        if run.planner != "static":  # keep what the planner produced with the run
            Run.objects.filter(pk=run.pk).update(plan={"steps": steps})
        created = Step.objects.bulk_create(
            Step(run=run, step_id=step["id"], position=position, tool=step["tool"], params=step["params"],
                 depends_on=step["depends_on"], timeout_s=step["timeout_s"], retries=step["retries"],
                 requested_plan=step.get("sandbox") or {})
            for position, step in enumerate(steps)
        )
        Event.objects.bulk_create(
            Event(type=EventType.TASK_SUBMITTED, run=run, task_id=step.step_id, timestamp=now,
                  message=f"{step.tool} step submitted", data={"depends_on": step.depends_on})
            for step in created
        )
        run_transition(run, S.POLICY_CHECK, caller="planner", expected=S.PLANNING,
                       trace=TraceRecord(TraceKind.TOOL_INVOCATION, {"tool": "planner", "steps": len(steps),
                                                                      **trace_data}))


def _check_policy(run: Run) -> None:
    decision = evaluate_policy(run)
    trace = TraceRecord(TraceKind.POLICY_DECISION, decision.data, error=decision.error)
    if decision.rejected:
        run_transition(run, S.REJECTED, caller="hitl controller", expected=S.POLICY_CHECK, trace=trace,
                       message=decision.error["message"] if decision.error else "rejected by policy")
    elif decision.risk == "high":
        with transaction.atomic():
            # Persisted before waiting: execution resumes from it after approval.
            Run.objects.filter(pk=run.pk).update(context={**run.context, "policy": decision.data})
            run_transition(run, S.AWAITING_HITL, caller="hitl controller", expected=S.POLICY_CHECK, trace=trace)
    else:
        run_transition(run, S.EXECUTING, caller="hitl controller", expected=S.POLICY_CHECK, trace=trace)


def run_cancel_awaiting_approval(run_id: int) -> Run | None:
    """Apply a stored cancel request to a run waiting for approval: CANCELLED,
    then closed. None when an approval, the expiry or the sweeper moved the
    run first (the request then applies wherever the run went)."""
    run = Run.objects.select_related("cancel_requested_by").get(pk=run_id)
    try:
        run_transition(run, S.CANCELLED, caller="user", actor=run.cancel_requested_by, expected=S.AWAITING_HITL)
        return run_close(run_id)
    except TransitionLost:
        return None


def run_close(run_id: int) -> Run | None:
    """Take a run from a transient state through TRACING to its final state.

    The RunTrace summary and the final AuditLog event commit with the final
    transition. If writing them fails the run stays in TRACING, where the
    sweeper finds it; it never skips to a final state.
    """
    run = Run.objects.filter(pk=run_id).first()
    if run is None or run.is_final:
        return run
    if run.state in TRANSIENT:
        run = run_transition(run, S.TRACING, caller="state machine", expected=run.state)
    if run.state != S.TRACING:
        return run
    target = FINAL_STATE_FOR_CAUSE[run.closing_cause]
    cancel_superseded = run.cancel_requested_at is not None and target != S.CLOSED_CANCELLED
    with transaction.atomic():
        lock_run(run_id)  # before the steps' rows, as everywhere
        fence_unfinished_steps(run, reason=f"run closed as {target}")
        run = run_transition(
            run, target, caller="tracer", expected=S.TRACING,
            actor=run.cancel_requested_by if target == S.CLOSED_CANCELLED else None,
            trace=TraceRecord(TraceKind.RUN, _run_summary(run)),
        )
        if target == S.SUCCEEDED:
            memory_write(run)
        if cancel_superseded:
            # A cancel that arrived too late to apply is answered, not dropped.
            AuditLog.objects.create(run=run, tenant_id=run.tenant_id, event="cancel_superseded",
                                    actor=run.cancel_requested_by, caller="tracer", to_state=target)
    return run


def _run_summary(run: Run) -> dict:
    transitions = list(run.traces.filter(kind=TraceKind.TRANSITION).values_list("to_state", "created_at"))
    stages = {}
    for (state, entered), (_next, left) in zip(transitions, transitions[1:]):
        stages[state] = round((left - entered).total_seconds() * 1000, 3)
    steps = list(run.steps.values("step_id", "status", "attempt"))
    return {
        "closing_cause": run.closing_cause,
        "stage_ms": stages,
        "total_ms": round((timezone.now() - run.created_at).total_seconds() * 1000, 3),
        "steps": steps,
        "attempts": sum(step["attempt"] for step in steps),
        "policy_traces": list(run.traces.filter(kind=TraceKind.POLICY_DECISION).values_list("id", flat=True)),
        "hitl_traces": list(run.traces.filter(kind=TraceKind.HITL_DECISION).values_list("id", flat=True)),
    }


def _close(run: Run) -> None:
    run_close(run.pk)


STAGES = {
    S.CREATED: lambda run: run_transition(run, S.PREPARING, caller="run manager", expected=S.CREATED),
    S.PREPARING: _prepare,
    S.PLANNING: _plan,
    S.POLICY_CHECK: _check_policy,
    S.REJECTED: _close,
    S.FAILED: _close,
    S.TIMEOUT: _close,
    S.CANCELLED: _close,
    S.TRACING: _close,
}
