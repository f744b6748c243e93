"""The approval requests in the Django admin: the approve and reject actions
follow the same rules as the decision service (separation of duties, the
tenant, a reason for a reject, the view the operator confirmed), and a
request cannot be added, changed or deleted there."""

import re

import pytest
from django.contrib.auth.models import User

from approvals.models import ApprovalRequest, ApprovalStatus, Decision
from runs.models import AuditLog, Run
from tests.approvals.interfaces_helpers import messages_of, signed_in, snapshot, submitted_by, waiting_run
from tests.conftest import make_user, open_approval

pytestmark = pytest.mark.django_db


# --- admin --------------------------------------------------------------------------------------


def superuser(username: str, tenant) -> User:
    user = make_user(username, tenant, groups=("approvers",))
    User.objects.filter(pk=user.pk).update(is_staff=True, is_superuser=True)
    user.refresh_from_db()
    return user


CHANGELIST = "/admin/approvals/approvalrequest/"


def admin_decide(client, action: str, approvals: list, comment: str = ""):
    """An admin action as an operator takes it: the action shows the
    requests with the digest of each (hidden fields), and its form decides."""
    selected = {"action": action, "_selected_action": [approval.pk for approval in approvals]}
    confirmation = client.post(CHANGELIST, selected)
    assert confirmation.status_code == 200
    html = confirmation.content.decode()
    digests = dict(re.findall(r'name="(digest-\d+)" value="([0-9a-f]{64})"', html))
    assert set(digests) == {f"digest-{approval.pk}" for approval in approvals}, html
    return client.post(CHANGELIST, {**selected, **digests, "confirmed": "yes", "comment": comment}, follow=True)


def test_the_admin_action_refuses_the_submitter(tenant, make_run):
    root = superuser("root", tenant)
    approval = open_approval(submitted_by(waiting_run(make_run), root))
    before = snapshot(approval)
    response = admin_decide(signed_in(root), "approve_selected", [approval])
    assert response.status_code == 200
    errors = [str(message) for message in response.context["messages"] if message.level_tag == "error"]
    assert len(errors) == 1 and f"request {approval.pk}" in errors[0] and "separation of duties" in errors[0], errors
    assert snapshot(approval) == before
    assert not Decision.objects.exists()


def test_the_admin_action_approves_for_an_approver_of_the_tenant(tenant, make_run):
    root = superuser("root", tenant)
    approval = open_approval(waiting_run(make_run))
    response = admin_decide(signed_in(root), "approve_selected", [approval])
    assert response.status_code == 200
    assert f"request {approval.pk}: approved" in messages_of(response)
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.APPROVED
    assert Run.objects.get(pk=approval.run_id).state == "EXECUTING"
    assert list(Decision.objects.values_list("decider__username", "decision")) == [("root", "approve")]


def test_the_admin_action_refuses_a_superuser_of_another_tenant(other_tenant, pending):
    root = superuser("globex-root", other_tenant)
    before = snapshot(pending)
    response = admin_decide(signed_in(root), "approve_selected", [pending])
    assert response.status_code == 200
    errors = [str(message) for message in response.context["messages"] if message.level_tag == "error"]
    assert errors == [f"request {pending.pk}: this request belongs to another tenant"], errors
    assert snapshot(pending) == before
    assert not Decision.objects.exists()


def test_the_admin_action_shows_what_it_decides_and_refuses_a_stale_view(tenant, make_run):
    root = superuser("root", tenant)
    approval = open_approval(waiting_run(make_run))
    client = signed_in(root)
    selected = {"action": "approve_selected", "_selected_action": [approval.pk]}
    confirmation = client.post(CHANGELIST, selected).content.decode()
    assert approval.action_digest in confirmation and not Decision.objects.exists()  # nothing decided yet
    seen = re.search(r'name="digest-\d+" value="([0-9a-f]{64})"', confirmation).group(1)
    ApprovalRequest.objects.filter(pk=approval.pk).update(action_digest="0" * 64)  # the plan changed meanwhile
    response = client.post(CHANGELIST, {**selected, f"digest-{approval.pk}": seen, "confirmed": "yes"}, follow=True)
    errors = [str(message) for message in response.context["messages"] if message.level_tag == "error"]
    assert errors == [f"request {approval.pk}: the plan changed since you opened it: reload"], errors
    assert not Decision.objects.exists()
    assert AuditLog.objects.filter(event="approval_stale_view", run_id=approval.run_id).count() == 1


def test_an_admin_reject_needs_a_reason(tenant, make_run):
    approval = open_approval(waiting_run(make_run))
    response = admin_decide(signed_in(superuser("root", tenant)), "reject_selected", [approval])
    assert messages_of(response) == [f"request {approval.pk}: A rejection needs a reason."]
    assert not Decision.objects.exists()


def test_approval_requests_cannot_be_added_changed_or_deleted_in_the_admin(tenant, pending):
    client = signed_in(superuser("root", tenant))
    assert client.get(f"{CHANGELIST}add/").status_code == 403
    assert client.post(f"{CHANGELIST}add/", {"status": "approved"}).status_code == 403
    assert client.get(f"{CHANGELIST}{pending.pk}/delete/").status_code == 403
    assert client.post(f"{CHANGELIST}{pending.pk}/delete/", {"post": "yes"}).status_code == 403
    assert client.post(f"{CHANGELIST}{pending.pk}/change/", {"status": "approved"}).status_code == 403
    response = client.get(f"{CHANGELIST}{pending.pk}/change/")
    assert response.status_code == 200  # read-only
    assert 'name="_save"' not in response.content.decode()
    listing = client.get(CHANGELIST)
    choices = [value for value, _ in listing.context["action_form"].fields["action"].choices if value]
    assert sorted(choices) == ["approve_selected", "reject_selected"]
    client.post(CHANGELIST, {"action": "delete_selected", "_selected_action": [pending.pk], "post": "yes"})
    assert snapshot(pending)[:3] == ("pending", None, "AWAITING_HITL")
    assert ApprovalRequest.objects.filter(pk=pending.pk).exists()
