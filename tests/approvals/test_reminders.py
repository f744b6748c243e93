"""Reminders and escalation: a pending request's approvers are reminded at
the tenant's fractions of its time, once each, whatever the number of
scans; after the escalation delay the escalation group is told, with a
link each, and one of them decides. A decided request is reminded of
nothing. (On real timings, with beat and a worker:
tests/approvals/test_reminders_timing.py.)"""

from datetime import timedelta

import pytest
from django.core import mail

from approvals.models import ApprovalRequest, DecisionLink, Notification
from approvals.notify import notification_send
from approvals.reminders import remind_and_escalate
from approvals.services import approval_decide
from policy.models import PolicyRule
from runs.errors import DeniedError
from runs.models import AuditLog, Tenant
from tests.approvals.decisions_helpers import pending_request
from tests.conftest import make_person, make_user

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _mail(settings):
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"



@pytest.fixture
def request_of(awaiting, tenant):
    """A request opened with the tenant's reminders at 50% and 90% and escalation after 60 s."""
    Tenant.objects.filter(pk=tenant.pk).update(approval_escalation_after_s=60)
    make_person("ann", tenant, "approvers")
    make_person("ben", tenant, "approvers")
    make_person("esme", tenant, "escalation")
    return pending_request(awaiting())


def kinds(request) -> list[tuple[str, str]]:
    return sorted(Notification.objects.filter(request=request).values_list("kind", "recipient__username"))


def test_approvers_are_reminded_at_each_fraction_once_and_the_escalation_group_told_after_the_delay(request_of):
    request = request_of
    start, span = request.requested_at, request.expires_at - request.requested_at

    assert remind_and_escalate(now=start + timedelta(seconds=59)) == {"reminders": 0, "escalations": 0}
    assert remind_and_escalate(now=start + timedelta(seconds=60)) == {"reminders": 0, "escalations": 1}
    assert [kind for kind in kinds(request) if kind[0] == "escalation"] == [("escalation", "esme")]
    assert DecisionLink.objects.filter(request=request, recipient__username="esme").count() == 1
    [escalated] = AuditLog.objects.filter(event="approval_escalated", run_id=request.run_id)
    assert escalated.data == {"request": request.pk, "group": "escalation", "told": ["esme"]}

    assert remind_and_escalate(now=start + span * 0.5 - timedelta(seconds=1))["reminders"] == 0
    assert remind_and_escalate(now=start + span * 0.5)["reminders"] == 1
    assert remind_and_escalate(now=start + span * 0.6) == {"reminders": 0, "escalations": 0}  # once each
    assert remind_and_escalate(now=start + span * 0.9)["reminders"] == 1
    assert remind_and_escalate(now=start + span * 0.95)["reminders"] == 0
    assert [kind for kind in kinds(request) if kind[0] == "reminder"] == [
        ("reminder", "ann"), ("reminder", "ann"), ("reminder", "ben"), ("reminder", "ben")]
    request.refresh_from_db()
    assert request.reminders_sent == 2

    for row in Notification.objects.filter(request=request, kind="reminder", recipient__username="ann"):
        notification_send(row.pk)
    assert all(message.subject.startswith("[ExecGo] Reminder: approval still needed") for message in mail.outbox)


def test_reminders_missed_while_no_scan_ran_are_sent_as_one_and_a_decided_request_gets_none(request_of, approver):
    request = request_of
    late = request.requested_at + (request.expires_at - request.requested_at) * 0.95
    assert remind_and_escalate(now=late) == {"reminders": 1, "escalations": 1}
    assert remind_and_escalate(now=late) == {"reminders": 0, "escalations": 0}

    approval_decide(request=request, actor=approver, approve=True, digest=request.action_digest)
    ApprovalRequest.objects.filter(pk=request.pk).update(reminders_sent=0, escalated_at=None)
    assert remind_and_escalate(now=late) == {"reminders": 0, "escalations": 0}


def test_the_escalation_group_decides_only_once_the_request_escalated(request_of, tenant):
    request = request_of
    esme = request.tenant.memberships.get(user__username="esme").user
    with pytest.raises(DeniedError):
        approval_decide(request=request, actor=esme, approve=True, digest=request.action_digest)
    remind_and_escalate(now=request.requested_at + timedelta(seconds=61))
    request.refresh_from_db()
    outcome = approval_decide(request=request, actor=esme, approve=True, digest=request.action_digest,
                              comment="escalated to me")
    assert outcome.request.status == "approved"
    assert list(outcome.request.decisions.values_list("decider__username", flat=True)) == ["esme"]


def test_an_escalation_group_member_who_submitted_the_run_is_not_told(awaiting, tenant, agent):
    Tenant.objects.filter(pk=tenant.pk).update(approval_escalation_after_s=1)
    agent.groups.add(*make_user("x", tenant, groups=("escalation",)).groups.all())
    request = pending_request(awaiting())
    remind_and_escalate(now=request.requested_at + timedelta(seconds=2))
    assert not Notification.objects.filter(request=request, kind="escalation", recipient=agent).exists()


def test_a_rule_s_own_reminders_and_escalation_delay_win_over_the_tenant_s(awaiting, tenant):
    Tenant.objects.filter(pk=tenant.pk).update(approval_escalation_after_s=60)
    make_person("ann", tenant, "approvers")
    make_person("esme", tenant, "escalation")
    PolicyRule.objects.filter(name="shell-package-install").update(reminder_fractions=[0.25], escalation_after_s=0)
    request = pending_request(awaiting())
    assert (request.reminder_fractions, request.escalation_after_s) == ([0.25], 0)
    span = request.expires_at - request.requested_at
    assert remind_and_escalate(now=request.requested_at + span * 0.25) == {"reminders": 1, "escalations": 0}
    assert remind_and_escalate(now=request.requested_at + span * 0.95) == {"reminders": 0, "escalations": 0}
