"""One-time decision links (docs/approvals.md#decision-links): what a link
from a notification may do.

Opening it (GET) decides nothing — mail scanners and chat unfurlers fetch
links — and shows the request to its approver, signed in. One POST by that
approver decides, through ``approval_decide`` on the digest the link was
made for. A link is single use and dies when its request is decided,
voided or expired or its plan changes. Every use and every refused use
(someone else's link, used, expired, stale) is audited.
"""

from django.db import transaction
from django.utils import timezone

from approvals.models import ApprovalStatus, DecisionLink
from approvals.services import REASON_NEEDED, Outcome, approval_decide
from runs.audit import audit
from runs.errors import ConflictError, DeniedError, ErrorCode, ExecGoError
from runs.models import AuditEvent
from runs.statemachine import RunState

SOMEONE_ELSES = "this link was sent to someone else"


def link_refusal(link: DecisionLink, user, *, now=None) -> str | None:
    """Why ``user`` may not use ``link`` now, or None."""
    now = now or timezone.now()
    request = link.request
    if user.pk != link.recipient_id:
        return SOMEONE_ELSES
    if link.used_at is not None:
        return "this link was used already"
    if request.status != ApprovalStatus.PENDING:
        return f"this request is {request.status}: nothing is pending"
    if now >= link.expires_at or now >= request.expires_at:
        return "this link expired"
    if request.action_digest != link.digest:
        return "the plan changed since this link was sent: open the request to see it as it is now"
    return None


def audit_refused(link: DecisionLink, user, reason: str, *, method: str) -> None:
    waiting = {"from_state": RunState.AWAITING_HITL} if link.request.status == ApprovalStatus.PENDING else {}
    audit(AuditEvent.DECISION_LINK_REFUSED, run_id=link.request.run_id, tenant_id=link.tenant_id, actor=user,
          caller="hitl controller", **waiting, data={"link": link.pk, "request": link.request_id, "recipient": link.recipient.get_username(),
                "reason": reason, "method": method})


def link_decide(link: DecisionLink, user, *, approve: bool, comment: str) -> Outcome:
    """Decide ``link``'s request as ``user``; the link is spent first, so two
    POSTs of one link decide once. Raises an ``ExecGoError`` when refused
    (audited)."""
    reason = link_refusal(link, user)
    if reason is not None:
        audit_refused(link, user, reason, method="POST")
        error = DeniedError if reason == SOMEONE_ELSES else ConflictError
        raise error(ErrorCode.DENIED if reason == SOMEONE_ELSES else ErrorCode.INVALID_INPUT, reason,
                    source="approval", details={"link": link.pk})
    comment = comment.strip()
    if not approve and not comment:
        raise ExecGoError(ErrorCode.INVALID_INPUT, REASON_NEEDED, source="approval",
                          details={"fields": {"comment": [REASON_NEEDED]}})
    verdict = "approve" if approve else "reject"
    with transaction.atomic():
        spent = DecisionLink.objects.filter(pk=link.pk, used_at__isnull=True).update(used_at=timezone.now(),
                                                                                    used_for=verdict)
    if not spent:
        audit_refused(link, user, "this link was used already", method="POST")
        raise ConflictError(ErrorCode.INVALID_INPUT, "this link was used already", source="approval",
                            details={"link": link.pk})
    outcome = approval_decide(request=link.request, actor=user, approve=approve, digest=link.digest,
                              comment=comment)
    audit(AuditEvent.DECISION_LINK_USED, run_id=link.request.run_id, tenant_id=link.tenant_id, actor=user,
          caller="hitl controller", data={"link": link.pk, "request": link.request_id, "decision": verdict})
    return outcome
