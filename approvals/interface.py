"""What the kernel (``runs``) may ask of approvals, and nothing more: open a
run's request as it enters AWAITING_HITL, and end a pending one when the run
leaves AWAITING_HITL another way (a cancel, the sweeper). Both work in the
caller's transaction; a request's status changes through
``approvals.lifecycle`` only."""

from datetime import timedelta

from approvals.lifecycle import ApprovalStatus, request_finish
from approvals.models import ApprovalRequest, action_digest, plan_version, quorum_of, rated_steps
from runs.models import Run, Step

__all__ = ["ApprovalStatus", "close_pending", "open_request"]


def open_request(run: Run, decision: dict, *, now) -> ApprovalRequest:
    """The pending request of ``run`` entering AWAITING_HITL with the
    policy's ``decision`` (its PolicyDecisionTrace data)."""
    steps = list(Step.objects.filter(run_id=run.pk).order_by("position"))
    rows = rated_steps(steps, decision)
    digest = action_digest(steps, decision["policy_version"])
    required = quorum_of(decision)
    return ApprovalRequest.objects.create(
        run=run, tenant_id=run.tenant_id, risk=decision["risk"], policy_version=decision["policy_version"],
        action_digest=digest, approvals_required=required,
        expires_at=now + timedelta(seconds=run.approval_timeout_s), steps=rows,
        versions=[plan_version("proposed", digest, rows, risk=decision["risk"], approvals_required=required,
                               at=now)],
    )


def close_pending(run_id: int, status: str, *, reason: str, now) -> list[ApprovalRequest]:
    """End the pending request of a run that left AWAITING_HITL another way
    (``status``: cancelled, or expired when the sweeper closes the run)."""
    closed = list(ApprovalRequest.objects.select_for_update().filter(run_id=run_id, status=ApprovalStatus.PENDING))
    for request in closed:
        request_finish(request, status, now=now, reason=reason)
    return closed
