"""A run's steps side by side as proposed, as approved and as executed, for
its page: what an approver changed, and that what ran is what was approved."""

from approvals.models import ApprovalStatus, normalised_action
from runs.models import Run, Step


def _action_text(action: dict | None) -> str:
    """One step's action as a reader compares it: what runs, and the plan it runs with."""
    if not action:
        return "—"
    if action.get("tool") == "shell":
        what = f"argv {action['argv']}" if "argv" in action else f"script {action.get('script', '')}"
        if "stdin_sha256" in action:
            what += f"\nstdin sha256:{action['stdin_sha256'][:12]}…"
    elif action.get("tool") == "http":
        what = f"{action.get('method')} {action.get('url')}"
    else:
        what = f"{action.get('op')} {action.get('path')}"
    plan = action.get("rated_plan") or action.get("plan")
    if plan:
        what += f"\nplan {plan.get('profile')}, network {plan.get('network')}, filesystem {plan.get('filesystem')}"
    return what


def plan_versions(run: Run, steps: list[Step]) -> list[dict]:
    """The run's steps side by side as the agent proposed them, as approved
    (the version the approving decisions named) and as executed (the
    stored step and the plan it ran with), each cell marked when it differs
    from the one before it."""
    request = run.approval_requests.order_by("-pk").first()
    versions = (request.versions or []) if request is not None else []
    if not versions:
        return []
    approved_digests = set(request.decisions.filter(decision="approve").values_list("digest", flat=True))
    approved = next((version for version in reversed(versions) if version["digest"] in approved_digests),
                    versions[-1] if request.status == ApprovalStatus.APPROVED else None)
    rows = []
    for step in steps:
        executed = {**normalised_action(step), "plan": step.effective_plan or None} if step.started_at else None
        proposed = next((row["action"] for row in versions[0]["steps"] if row["action"]["id"] == step.step_id), None)
        chosen = next((row["action"] for row in approved["steps"] if row["action"]["id"] == step.step_id),
                      None) if approved else None
        texts = [_action_text(proposed), _action_text(chosen) if approved else "not approved",
                 _action_text(executed) if executed else "not run"]
        rows.append({"step": step.step_id, "cells": [
            {"text": text, "changed": index > 0 and text not in ("not run", "not approved")
             and texts[index - 1] not in ("not run", "not approved") and text != texts[index - 1]}
            for index, text in enumerate(texts)]})
    return rows
