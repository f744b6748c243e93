"""Approve with edits: an approver narrows a step's arguments (a shell
step's argv or script, an http step's URL) before approving.

The edited plan is validated like a submitted one and rated again, in
full, by the policy gate; an edit the policy denies is refused with its
reasons. An accepted edit replaces the steps' params (the run executes
exactly what was approved), the request keeps the original steps beside the
edited ones and every version in ``versions``, binds to the edited plan's
digest and needs what the larger of the two plans needs (``apply_edit``).
"""

import copy

from approvals.models import ApprovalRequest, action_digest, plan_version, quorum_of, rated_steps
from policy.interface import RISK_ORDER, PolicyDecision, evaluate_policy
from runs.dataplane import bind_rated_plans_of
from runs.errors import ErrorCode, ExecGoError
from runs.models import Event, EventType, Run, Step
from runs.outbox import emit
from runs.plan_schema import validate_plan

# What an approver may change, per tool.
EDITABLE = {"shell": ("argv", "script"), "http": ("url",)}


def _refused(message: str, **details) -> ExecGoError:
    return ExecGoError(ErrorCode.INVALID_INPUT, message, source="approval", details=details)


def edited_steps(run: Run, steps: list[Step], edits: dict[str, dict]) -> list[Step]:
    """Copies of ``steps`` with ``edits`` ({step id: {param: value}}) applied;
    raises invalid_input for anything but a valid narrowing of an editable field."""
    by_id = {step.step_id: step for step in steps}
    edited = []
    for step in steps:
        change = edits.get(step.step_id)
        copy_of = copy.copy(step)
        if change:
            allowed = EDITABLE.get(step.tool, ())
            unknown = sorted(set(change) - set(allowed))
            if unknown:
                raise _refused(f"step {step.step_id!r}: only {', '.join(allowed) or 'nothing'} may be edited",
                               step=step.step_id, fields=unknown)
            params = copy.deepcopy(step.params)
            if step.tool == "shell":  # argv and script replace each other
                params.pop("argv", None)
                params.pop("script", None)
            params.update(change)
            copy_of.params = params
        edited.append(copy_of)
    unknown_steps = sorted(set(edits) - set(by_id))
    if unknown_steps:
        raise _refused(f"no such step: {', '.join(unknown_steps)}", steps=unknown_steps)
    plan = {"steps": [{"id": s.step_id, "tool": s.tool, "params": s.params, "depends_on": s.depends_on,
                       "timeout_s": s.timeout_s, "retries": s.retries,
                       **({"sandbox": s.requested_plan} if s.requested_plan else {})} for s in edited]}
    try:
        validate_plan(plan)
    except ExecGoError as exc:
        raise _refused(f"the edited plan is not valid: {exc.envelope['message']}", **exc.envelope["details"]) from None
    return edited


def rate_edit(run: Run, edited: list[Step]) -> PolicyDecision:
    decision = evaluate_policy(run, steps=edited)
    if decision.rejected:
        reasons = [f"{row['id']}: {'; '.join(row['reasons'])}" for row in decision.data["steps"]
                   if row["risk"] == "deny"] or [decision.error["message"] if decision.error else "denied"]
        raise ExecGoError(ErrorCode.DENIED, f"the policy denies the edited plan: {' | '.join(reasons)}",
                          source="policy", details={"decision": decision.data})
    return decision


def apply_edit(request: ApprovalRequest, run: Run, original: list[Step], edited: list[Step],
               decision: PolicyDecision, actor, *, now) -> None:
    """In the caller's transaction: the edited params replace the stored ones
    and the request binds to the edited plan, re-rated in full. An edit never
    lowers what is needed: the request then needs the larger of the two
    quorums, and an edit that raised the risk or the quorum needs at least
    one approver besides its editor (whose decision counts once)."""
    changed = [step for step, before in zip(edited, original) if step.params != before.params]
    for step in changed:
        Step.objects.filter(pk=step.pk).update(params=step.params)
    # run.plan is what will run, whichever planner made it (the agent's
    # original stays in submitted_plan, an llm planner's goal in goal).
    params = {step.step_id: step.params for step in edited}
    Run.objects.filter(pk=run.pk).update(plan={"steps": [
        {**entry, "params": params.get(entry.get("id"), entry.get("params"))}
        for entry in (run.plan or {}).get("steps", [])
    ]})
    bind_rated_plans_of(edited, decision.data)  # the edited plan as rated is what the digest binds
    edited_quorum = quorum_of(decision.data)
    raised = (RISK_ORDER[decision.risk] > RISK_ORDER.get(request.risk, 0)
              or edited_quorum > request.approvals_required)
    request.original_steps = request.original_steps or request.steps
    request.steps = [{**row, "edited": step in changed}
                     for row, step in zip(rated_steps(edited, decision.data), edited)]
    request.action_digest = action_digest(edited, decision.data["policy_version"])
    request.policy_version = decision.data["policy_version"]
    request.approvals_required = max(request.approvals_required, edited_quorum, 2 if raised else 1)
    request.risk = decision.risk
    request.edited_by = actor
    request.versions = [*request.versions, plan_version(
        "edited", request.action_digest, request.steps, risk=decision.risk,
        approvals_required=request.approvals_required, at=now, by=actor)]
    request.save(update_fields=["original_steps", "steps", "action_digest", "policy_version", "approvals_required",
                                "risk", "edited_by", "versions"])
    # Whoever has the request open is told at once that it changed under them.
    emit([Event(type=EventType.APPROVAL_CHANGED, run=run, timestamp=now, message="approval request edited",
                data={"request": request.pk, "digest": request.action_digest, "edited_by": actor.get_username(),
                      "approvals_required": request.approvals_required})])
