"""Reminders and escalation (docs/approvals.md#reminders-and-escalation).

A pending request's approvers are reminded at fractions of its time
(the rule's that rated it high, else ``Tenant.approval_reminder_fractions``,
50% and 90% by default); once the escalation delay has passed (the rule's,
else ``Tenant.approval_escalation_after_s``; 0: never), the members
of the tenant's escalation group (``Tenant.approval_escalation_group``) are
told too, each with a decision link, and may then decide the request.

Beat runs ``remind_and_escalate`` every ``EXECGO_REMINDER_SCAN_INTERVAL_S``
seconds. What was sent is on the request (``reminders_sent``,
``escalated_at``), written with the notifications in one transaction under
the request's row lock, so a reminder due is sent once, and one missed
while no worker ran is sent at the next scan: nothing is lost when a
worker dies, and two scans never send one twice.
"""

from datetime import timedelta

from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from approvals.models import AGENTS_GROUP, ApprovalRequest, ApprovalStatus, NotificationKind
from approvals.notify import approvers_of, notify_request
from runs.audit import audit
from runs.models import AuditEvent
from runs.statemachine import RunState


def reminders_due(request: ApprovalRequest, now) -> int:
    """How many of the tenant's reminder moments of ``request`` have passed."""
    span = request.expires_at - request.requested_at
    fractions = request.reminder_fractions if request.reminder_fractions is not None else (
        request.tenant.approval_reminder_fractions or [])
    return sum(1 for fraction in fractions if isinstance(fraction, (int, float)) and 0 < fraction < 1
               and request.requested_at + span * fraction <= now)


def escalation_due(request: ApprovalRequest, now) -> bool:
    delay = request.escalation_after_s if request.escalation_after_s is not None else (
        request.tenant.approval_escalation_after_s)
    return bool(delay) and request.escalated_at is None and now >= request.requested_at + timedelta(seconds=delay)


def escalation_members(request: ApprovalRequest):
    """Who an escalation tells: the tenant's escalation group, not agents, not the run's submitter."""
    return (get_user_model().objects.filter(is_active=True, membership__tenant_id=request.tenant_id,
                                            groups__name=request.tenant.approval_escalation_group)
            .exclude(groups__name=AGENTS_GROUP).exclude(pk=request.run.submitted_by_id).distinct())


def remind_and_escalate(now=None) -> dict[str, int]:
    """Send the reminders and escalations due; how many of each."""
    now = now or timezone.now()
    sent = {"reminders": 0, "escalations": 0}
    pending = ApprovalRequest.objects.filter(status=ApprovalStatus.PENDING, expires_at__gt=now).select_related(
        "tenant", "run")
    for request in pending:
        if reminders_due(request, now) > request.reminders_sent or escalation_due(request, now):
            sent_one = _send_due(request.pk, now)
            sent["reminders"] += sent_one[0]
            sent["escalations"] += sent_one[1]
    return sent


def _send_due(request_id: int, now) -> tuple[int, int]:
    with transaction.atomic():
        request = ApprovalRequest.objects.select_for_update().select_related("tenant", "run").filter(
            pk=request_id, status=ApprovalStatus.PENDING).first()
        if request is None:
            return 0, 0
        reminded = escalated = 0
        due = reminders_due(request, now)
        if due > request.reminders_sent:  # several passed at once (no scan ran): one reminder for them
            ApprovalRequest.objects.filter(pk=request.pk).update(reminders_sent=due)
            request.reminders_sent = due
            notify_request(request, NotificationKind.REMINDER, recipients=approvers_of(request))
            reminded = 1
        if escalation_due(request, now):
            ApprovalRequest.objects.filter(pk=request.pk).update(escalated_at=now)
            request.escalated_at = now
            members = list(escalation_members(request))
            notify_request(request, NotificationKind.ESCALATION, recipients=members)
            audit(AuditEvent.APPROVAL_ESCALATED, run_id=request.run_id, tenant_id=request.tenant_id,
                  caller="hitl controller", from_state=RunState.AWAITING_HITL,
                  data={"request": request.pk, "group": request.tenant.approval_escalation_group,
                        "told": [member.get_username() for member in members]})
            escalated = 1
    return reminded, escalated
