"""Approve with edits: an approver narrows a step's arguments (a shell
step's argv or script, an http step's URL) before approving.

The edited plan is validated like a submitted one and rated again by the
policy gate; an edit the policy denies is refused with its reasons. An
accepted edit replaces the steps' params (the run executes exactly what was
approved), and the request keeps the original steps beside the edited ones
and binds to the edited plan's digest.
"""

import copy

from approvals.models import ApprovalRequest, action_digest, normalised_action, shown_action
from runs.errors import ErrorCode, ExecGoError
from runs.models import Run, Step
from runs.plan_schema import validate_plan
from runs.policy import PolicyDecision, evaluate_policy

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
               decision: PolicyDecision, actor) -> None:
    """In the caller's transaction: the edited params replace the stored ones
    and the request binds to the edited plan."""
    changed = [step for step, before in zip(edited, original) if step.params != before.params]
    for step in changed:
        Step.objects.filter(pk=step.pk).update(params=step.params)
    Run.objects.filter(pk=run.pk).update(plan={"steps": [
        {**entry, "params": next(s.params for s in edited if s.step_id == entry["id"])}
        for entry in (run.plan or {}).get("steps", [])
    ]} if run.planner == "static" else run.plan)
    rated = {row["id"]: row for row in decision.data["steps"]}
    request.original_steps = request.original_steps or request.steps
    request.steps = [{"action": normalised_action(step), "shown": shown_action(step),
                      "risk": rated.get(step.step_id, {}).get("risk", "low"),
                      "reasons": rated.get(step.step_id, {}).get("reasons", []),
                      "edited": step in changed} for step in edited]
    request.action_digest = action_digest(edited, decision.data["policy_version"])
    request.policy_version = decision.data["policy_version"]
    request.edited_by = actor
    request.save(update_fields=["original_steps", "steps", "action_digest", "policy_version", "edited_by"])
