"""The harness stages that drive a run from CREATED to a final state.

Each stage does its work and takes exactly one edge of the state machine;
a failure takes the failure edge, never "stays". The stages start from the
run as the database has it, so a duplicate delivery of the driving task, or
a second worker, finds the run moved on and stops (the first transition's
optimistic lock decides; the next ones hold the run's row lock).
"""

import logging
from dataclasses import replace

from django.db import transaction
from django.utils import timezone

from approvals import interface as approvals
from policy.interface import evaluate_policy
from runs.audit import audit
from runs.closing import run_cancel_awaiting_approval, run_close
from runs.context import assemble_context
from runs.dataplane import bind_rated_plans
from runs.dispatch import Claim, enqueue_approval_expiry
from runs.errors import ExecGoError
from runs.models import AuditEvent, Event, EventType, Run, Step, TraceKind
from runs.outbox import emit
from runs.planners import PlanningFailed, plan_run
from runs.settle import close_unused, executing_started, run_settle, warm_first
from runs.statemachine import ENTERED_ONCE, RunState
from runs.transitions import RUN_ROW, TraceRecord, TransitionLost, recorded_at_the_end, run_transition
from runs.webhooks import run_callback_payload, webhook_configured, webhook_notify
from runtime import statements

S = RunState
logger = logging.getLogger(__name__)


def run_advance(run_id: int) -> Claim | None:
    """Drive the run as far as it can go without outside input; once it is
    EXECUTING, dispatch its first steps and hand one back to run in-process.

    The stages commit together, with the first steps' dispatch: one
    transaction from CREATED to the first step's start (each transition
    still recorded, projected and audited on its own). A planner that calls
    out (``llm``) is called between two such transactions, never inside one."""
    while True:
        try:
            with transaction.atomic(), recorded_at_the_end():
                advanced = _advance(run_id)
        except TransitionLost as lost:
            # Lost only by the first stage: from its first transition on the
            # transaction holds the run's row lock (SQLite: its write lock),
            # and no writer can move the run. So nothing of this transaction
            # is worth keeping, and the stages' blocks need no savepoints.
            logger.info("run %s: %s; another writer drives it", run_id, lost)
            return None
        if advanced is not _PLAN_OUTSIDE:
            return advanced
        run = Run.objects.filter(pk=run_id).first()
        if run is None:  # deleted since (its tenant removed): nothing to plan
            return None
        try:
            _plan(run)
        except TransitionLost as lost:
            logger.info("run %s: %s; another writer drives it", run_id, lost)
            return None


# ``_advance``: the run is to be planned by a planner that calls out.
_PLAN_OUTSIDE = object()


def _advance(run_id: int):
    """The stages, in the caller's transaction (what they record is held
    to be written at its end: ``transitions.recorded_at_the_end``). A stage
    that loses its run to another writer raises ``TransitionLost`` out of
    the transaction."""
    run = statements.select(Run, run_id, (*RUN_ROW, "plan"))  # the plan too, which planning reads
    # The first stage's transition moves this copy too (``held``): read
    # outside the row lock, but in a state a run enters only once, so it can
    # be stale only by the run having moved on, which that transition's
    # UPDATE (filtered on the state) finds. It takes the lock.
    held = run is not None and run.state in ENTERED_ONCE
    while True:
        if run is None or run.is_final:
            return None
        if run.state == S.EXECUTING:
            claim = run_settle(run_id, claim_one=True, first=True, steps=getattr(run, "planned_steps", None),
                               warmed=getattr(run, "first_spare", None))
            if claim is None:  # nothing runs here now: the timer at once
                executing_started(run)
                return None
            # The chain this claim starts arms it if the run outlives it (``execute_claims``).
            return replace(claim, timer_owed=run)
        if run.state == S.AWAITING_HITL and run.cancel_requested_at is not None:
            # A cancel requested before the run reached its first state with a
            # CANCELLED edge is applied here, not left for the approver.
            run_cancel_awaiting_approval(run_id)
            return None
        if run.state == S.PLANNING and run.planner != "static":
            return _PLAN_OUTSIDE
        stage = STAGES.get(run.state)
        if stage is None:  # AWAITING_HITL: a human or the expiry moves it
            return None
        moved = stage(run, held)
        # The run as the stage's last transition saved it, under the row lock
        # this transaction holds from then on: no other writer can have moved
        # it since (a cancel waits for the commit), and the next stage's
        # transition moves this copy without reading the run again.
        held = True
        run = moved if moved is not None else statements.select(Run, run_id, RUN_ROW)


def _prepare(run: Run, held: bool) -> Run:
    try:
        assembled = assemble_context(run)
    except ExecGoError as exc:
        return run_transition(run, S.FAILED, expected=S.PREPARING, held=held,
                              message=exc.envelope["message"],
                              trace=TraceRecord(TraceKind.MEMORY_RETRIEVE, exc.envelope["details"],
                                                error=exc.envelope))
    with statements.in_transaction():
        Run.objects.filter(pk=run.pk).update(context=assembled.context)
        return run_transition(run, S.PLANNING, expected=S.PREPARING, held=held,
                              trace=TraceRecord(TraceKind.MEMORY_RETRIEVE, assembled.trace))


def _plan(run: Run, held: bool = False) -> Run:
    try:
        steps, trace_data = plan_run(run)
    except PlanningFailed as failure:
        return run_transition(run, S.TIMEOUT if failure.timed_out else S.FAILED, expected=S.PLANNING, held=held,
                              message=failure.envelope["message"],
                              trace=TraceRecord(TraceKind.TOOL_INVOCATION, {"tool": "planner", **failure.trace_data},
                                                error=failure.envelope))
    now = timezone.now()
    with statements.in_transaction():
        if run.planner != "static":  # keep what the planner produced with the run
            Run.objects.filter(pk=run.pk).update(plan={"steps": steps})
        created = Step.objects.bulk_create(
            Step(run=run, step_id=step["id"], position=position, tool=step["tool"], params=step["params"],
                 depends_on=step["depends_on"], timeout_s=step["timeout_s"], retries=step["retries"],
                 requested_plan=step.get("sandbox") or {})
            for position, step in enumerate(steps)
        )
        emit([Event(type=EventType.TASK_SUBMITTED, run=run, task_id=step.step_id, timestamp=now,
                    message=f"{step.tool} step submitted", data={"depends_on": step.depends_on})
              for step in created])
        # Handed on with the run to the next stages of this transaction, which
        # hold its row lock: they rate and start these, not a read of them.
        run.planned_steps = created
        return run_transition(run, S.POLICY_CHECK, expected=S.PLANNING, held=held,
                              trace=TraceRecord(TraceKind.TOOL_INVOCATION, {"tool": "planner", "steps": len(steps),
                                                                             **trace_data}))


def _check_policy(run: Run, held: bool) -> Run:
    planned = getattr(run, "planned_steps", None)  # else read: the stages began at POLICY_CHECK
    decision = evaluate_policy(run, planned)
    trace = TraceRecord(TraceKind.POLICY_DECISION, decision.data, error=decision.error)
    if decision.rejected:
        return run_transition(run, S.REJECTED, expected=S.POLICY_CHECK, held=held, trace=trace,
                              message=decision.error["message"] if decision.error else "rejected by policy")
    if decision.risk == "high":
        with statements.in_transaction():
            # Before the request (its digest binds them) or a grant's match.
            bind_rated_plans(run.pk, decision.data, steps=planned)
            granted = approvals.covering_grants(run, decision.data)
            if granted is not None:  # every high-risk step allowed again by an approver: no wait
                decision.data["standing_grants"] = granted
                trace = TraceRecord(TraceKind.POLICY_DECISION, decision.data, error=decision.error)
            # Persisted before waiting: execution resumes from it after approval.
            Run.objects.filter(pk=run.pk).update(context={**run.context, "policy": decision.data})
            if granted is not None:
                moved = run_transition(run, S.EXECUTING, expected=S.POLICY_CHECK, held=held, trace=trace)
                audit(AuditEvent.GRANT_APPLIED, run_id=run.pk, tenant_id=run.tenant_id, caller="hitl controller",
                      from_state=S.POLICY_CHECK, to_state=S.EXECUTING, data={"grants": granted})
            else:
                moved = run_transition(run, S.AWAITING_HITL, expected=S.POLICY_CHECK, held=held, trace=trace)
                _request_approval(run, decision.data)
            return moved
    # The run executes now: the first step's sandbox is set up while its
    # rating is bound and the stages dispatch it (``warm_first``: run_settle
    # keeps the spare if the step and plan forecast once bound are the same).
    warmed = warm_first(planned) if planned else None
    try:
        with statements.in_transaction():
            bind_rated_plans(run.pk, decision.data, steps=planned)
            moved = run_transition(run, S.EXECUTING, expected=S.POLICY_CHECK, held=held, trace=trace)
    except BaseException:
        if warmed is not None:
            close_unused(*warmed)  # rolled back: no step names its handle
        raise
    moved.first_spare = warmed  # run_settle's now, to use or close
    return moved


def _request_approval(run: Run, decision: dict) -> None:
    """The approval request of a run entering AWAITING_HITL (same
    transaction), its expiry, sent for the moment it is due, and the
    approvers' notification (a webhook row in the same transaction, sent
    after commit; its delivery never touches the run)."""
    approval = approvals.open_request(run, decision, now=timezone.now())
    audit(AuditEvent.APPROVAL_REQUESTED, run_id=run.pk, tenant_id=run.tenant_id, caller="hitl controller",
          to_state=S.AWAITING_HITL, data={"request": approval.pk, "approvals_required": approval.approvals_required,
                                          "expires_at": approval.expires_at.isoformat()})
    enqueue_approval_expiry(approval.pk, eta=approval.expires_at)
    approval.notify_requested()
    approvals.notify_approvers(approval)
    if run.callback_url and "awaiting_human" in run.callback_events and webhook_configured(run.callback_url):
        webhook_notify("run.awaiting_human", {**run_callback_payload(run), "state": S.AWAITING_HITL,
                                              "approval": {"page": f"/approvals/{approval.pk}/",
                                                           "api": f"/api/v1/approvals/{approval.pk}"}},
                       url=run.callback_url, run_id=run.pk, tenant_id=run.tenant_id)


def _close(run: Run, held: bool) -> Run | None:
    return run_close(run.pk)


STAGES = {
    S.CREATED: lambda run, held: run_transition(run, S.PREPARING, expected=S.CREATED, held=held),
    S.PREPARING: _prepare,
    S.PLANNING: _plan,
    S.POLICY_CHECK: _check_policy,
    S.REJECTED: _close,
    S.FAILED: _close,
    S.TIMEOUT: _close,
    S.CANCELLED: _close,
    S.TRACING: _close,
}
