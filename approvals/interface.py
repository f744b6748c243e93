"""What the kernel (``runs``) may ask of approvals, and nothing more: the
standing grants that let a high-risk run go on without waiting
(``covering_grants``), open a run's request as it enters AWAITING_HITL, and
end a pending one when the run leaves AWAITING_HITL another way (a cancel,
the sweeper). All work in the caller's transaction; a request's status
changes through ``approvals.lifecycle`` only."""

from datetime import timedelta

from django.db.models import F
from django.utils import timezone

from approvals.lifecycle import ApprovalStatus, request_finish
from approvals.models import (
    ApprovalRequest,
    StandingGrant,
    action_digest,
    grant_digest,
    plan_version,
    quorum_of,
    rated_steps,
    reminders_of,
)
from approvals.notify import notify_request
from runs.models import Run, Step

__all__ = ["ApprovalStatus", "close_pending", "covering_grants", "notify_approvers", "open_request"]


def open_request(run: Run, decision: dict, *, now) -> ApprovalRequest:
    """The pending request of ``run`` entering AWAITING_HITL with the
    policy's ``decision`` (its PolicyDecisionTrace data)."""
    steps = list(Step.objects.filter(run_id=run.pk).order_by("position"))
    rows = rated_steps(steps, decision)
    digest = action_digest(steps, decision["policy_version"])
    required = quorum_of(decision)
    fractions, escalation_after_s = reminders_of(decision)
    return ApprovalRequest.objects.create(
        run=run, tenant_id=run.tenant_id, risk=decision["risk"], policy_version=decision["policy_version"],
        action_digest=digest, approvals_required=required, reminder_fractions=fractions,
        escalation_after_s=escalation_after_s,
        expires_at=now + timedelta(seconds=run.approval_timeout_s), steps=rows,
        versions=[plan_version("proposed", digest, rows, risk=decision["risk"], approvals_required=required,
                               at=now)],
    )


def notify_approvers(request: ApprovalRequest) -> None:
    """Tell the approvers of a request just opened (e-mail, chat; each with
    a one-time decision link), in the caller's transaction, sent after it."""
    notify_request(request, "requested")


def close_pending(run_id: int, status: str, *, reason: str, now) -> list[ApprovalRequest]:
    """End the pending request of a run that left AWAITING_HITL another way
    (``status``: cancelled, or expired when the sweeper closes the run)."""
    closed = list(ApprovalRequest.objects.select_for_update().filter(run_id=run_id, status=ApprovalStatus.PENDING))
    for request in closed:
        request_finish(request, status, now=now, reason=reason)
    return closed


def covering_grants(run: Run, decision: dict) -> list[dict] | None:
    """The live grants that cover every high-risk step of ``run`` rated by
    ``decision`` (one per step, the one that lasts longest), counted as
    used; None when one step has none or the plan needs more than one
    approver. In the caller's transaction."""
    high = [row["id"] for row in decision["steps"] if row["risk"] == "high"]
    if not high or quorum_of(decision) > 1:
        return None
    now = timezone.now()
    live = StandingGrant.objects.live(now).filter(tenant_id=run.tenant_id, agent_id=run.submitted_by_id)
    steps = {step.step_id: step for step in Step.objects.filter(run_id=run.pk, step_id__in=high)}
    cited = []
    for step_id in high:
        grant = live.filter(digest=grant_digest(steps[step_id])).order_by("-expires_at").select_related(
            "granted_by").first()
        if grant is None:
            return None
        cited.append({"step": step_id, "grant": grant.pk, "granted_by": grant.granted_by.get_username(),
                      "request": grant.request_id, "expires_at": grant.expires_at.isoformat()})
    StandingGrant.objects.filter(pk__in={entry["grant"] for entry in cited}).update(uses=F("uses") + 1,
                                                                                  last_used_at=now)
    return cited
