"""Delegation: an approver away until a time names a delegate (an approver
of the same tenant); meanwhile what they would be told goes to the delegate,
who counts once in a quorum whatever roles they hold; a delegate who
submitted the run is never told in their place; setting it is audited."""

from datetime import timedelta

import pytest
from django.utils import timezone

from approvals.models import ApprovalRequest, Notification, NotificationSettings
from approvals.reminders import remind_and_escalate
from approvals.services import approval_decide
from runs.errors import ConflictError
from runs.models import AuditLog
from tests.approvals.decisions_helpers import pending_request
from tests.approvals.interfaces_helpers import signed_in
from tests.conftest import make_person

pytestmark = pytest.mark.django_db



@pytest.fixture
def team(tenant, other_tenant):
    return {name: make_person(name, tenant, "approvers") for name in ("ann", "ben", "cat")} | {
        "eve": make_person("eve", other_tenant, "approvers"), "bot": make_person("bot", tenant, "approvers", "agents")}


def away(user, delegate, hours=2):
    NotificationSettings.objects.update_or_create(user=user, defaults={
        "away_until": timezone.now() + timedelta(hours=hours), "delegate": delegate})


def told(request, kind="requested") -> list[str]:
    return sorted(Notification.objects.filter(request=request, kind=kind).values_list("recipient__username",
                                                                                       flat=True))


def test_while_away_the_delegate_is_told_instead_and_after_it_the_approver_again(team, awaiting):
    away(team["ann"], team["cat"])
    request = pending_request(awaiting())
    assert told(request) == ["ben", "cat"]  # ann's message went to cat, who is told once
    remind_and_escalate(now=request.requested_at + (request.expires_at - request.requested_at) * 0.5)
    assert told(request, "reminder") == ["ben", "cat"]

    NotificationSettings.objects.filter(user=team["ann"]).update(away_until=timezone.now() - timedelta(seconds=1))
    assert told(pending_request(awaiting())) == ["ann", "ben", "cat"]


def test_a_delegate_counts_once_in_a_quorum(team, awaiting):
    away(team["ann"], team["cat"])
    request = pending_request(awaiting())
    ApprovalRequest.objects.filter(pk=request.pk).update(approvals_required=2)
    request.refresh_from_db()
    outcome = approval_decide(request=request, actor=team["cat"], approve=True, digest=request.action_digest)
    assert (outcome.request.status, outcome.approvals) == ("pending", 1)
    with pytest.raises(ConflictError):  # deciding again "for ann" is cat deciding twice
        approval_decide(request=request, actor=team["cat"], approve=True, digest=request.action_digest)
    assert approval_decide(request=request, actor=team["ben"], approve=True,
                           digest=request.action_digest).request.status == "approved"


def test_a_delegate_who_submitted_the_run_is_never_told_in_the_approver_s_place(team, tenant, awaiting):
    submitter = team["cat"]
    away(team["ann"], submitter)
    request = pending_request(awaiting(user=submitter))
    assert told(request) == ["ann", "ben"]  # cat submitted it: ann is told herself
    with pytest.raises(Exception, match="separation of duties"):
        approval_decide(request=request, actor=submitter, approve=True, digest=request.action_digest)


def test_the_settings_page_names_only_an_approver_of_the_tenant_and_audits_the_delegation(team):
    ann = signed_in(team["ann"], enforce_csrf_checks=False)
    form = ann.get("/approvals/settings/").context["form"]
    assert [user.username for user in form.fields["delegate"].queryset] == ["ben", "cat"]
    until = (timezone.now() + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")
    for outsider in (team["eve"], team["bot"], team["ann"]):
        refused = ann.post("/approvals/settings/", {"email": "on", "chat_format": "slack", "away_until": until,
                                                    "delegate": outsider.pk})
        assert refused.status_code == 200 and "delegate" in refused.context["form"].errors
    missing = ann.post("/approvals/settings/", {"email": "on", "chat_format": "slack", "away_until": until})
    assert "delegate" in missing.context["form"].errors
    assert ann.post("/approvals/settings/", {"email": "on", "chat_format": "slack", "away_until": until,
                                             "delegate": team["ben"].pk}).status_code == 302
    prefs = NotificationSettings.objects.get(user=team["ann"])
    assert prefs.delegate == team["ben"] and prefs.away(timezone.now())
    [row] = AuditLog.objects.filter(event="delegation_set", actor=team["ann"])
    assert row.data["delegate"] == "ben" and row.data["away_until"].startswith(until[:13])
