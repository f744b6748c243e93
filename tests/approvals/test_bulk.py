"""Bulk decisions through the API and the inbox's form: each request is
decided on the digest its approver read, a stale or refused one is
reported and left pending while the others are decided, and a malformed
batch decides nothing. (In Chromium: tests/pages/test_approvals_browser.py.)"""

import pytest

from approvals.models import ApprovalRequest, Decision
from runs.models import AuditLog, Run
from tests.approvals.decisions_helpers import pending_request
from tests.approvals.interfaces_helpers import error_of, signed_in
from tests.conftest import make_user, token_client

pytestmark = pytest.mark.django_db


def bulk(user, decision: str, picks: list[tuple[int, str]], comment: str = "", **extra):
    return token_client(user).post("/api/v1/approvals/bulk", {
        "decision": decision, "comment": comment, "requests": [{"id": pk, "digest": digest} for pk, digest in picks],
        **extra}, format="json")


@pytest.fixture
def three(awaiting):
    """Three requests waiting, as their approver read them."""
    return [pending_request(awaiting()) for _ in range(3)]


def test_with_one_stale_item_the_others_are_decided_and_the_stale_one_reported_and_left_pending(
        three, approver, second_approver, django_capture_on_commit_callbacks):
    first, stale, third = three
    read = {request.pk: request.action_digest for request in three}
    # Another approver edits the middle one after it was read: its digest changes (two approvers needed,
    # so the edit leaves it pending).
    ApprovalRequest.objects.filter(pk=stale.pk).update(approvals_required=2)
    edited = token_client(second_approver).post(
        f"/api/v1/approvals/{stale.pk}/approve",
        {"digest": stale.action_digest, "edits": {"install": {"argv": ["pip", "install", "--dry-run", "requests"]}}},
        format="json")
    assert edited.status_code == 200, edited.content
    assert edited.json()["action_digest"] != read[stale.pk]

    with django_capture_on_commit_callbacks(execute=False):
        response = bulk(approver, "approve", list(read.items()), comment="fine, all three")
    assert response.status_code == 200, response.content
    results = {row["id"]: row for row in response.json()["results"]}
    assert [row["id"] for row in response.json()["results"]] == [first.pk, stale.pk, third.pk]
    for decided in (first, third):
        assert results[decided.pk] == {"id": decided.pk, "decided": True, "status": "approved", "approvals": 1,
                                       "approvals_required": 1, "error": None}
        assert Run.objects.get(pk=decided.run_id).state == "EXECUTING"
        assert Decision.objects.get(request=decided).comment == "fine, all three"
    refused = results[stale.pk]
    assert (refused["decided"], refused["status"]) == (False, "pending")
    assert refused["error"]["code"] == "invalid_input" and refused["error"]["details"]["reason"] == "stale_view"
    stale.refresh_from_db()
    assert stale.status == "pending" and not stale.decisions.filter(decider=approver).exists()
    assert Run.objects.get(pk=stale.run_id).state == "AWAITING_HITL"
    [audited] = AuditLog.objects.filter(event="approval_stale_view", run_id=stale.run_id)
    assert audited.data["seen_digest"] == read[stale.pk] and audited.actor == approver


def test_a_bulk_reject_needs_a_reason_and_decides_nothing_without_one(three, approver):
    picks = [(request.pk, request.action_digest) for request in three]
    error = error_of(bulk(approver, "reject", picks, comment="  "), 400, "invalid_input")
    assert "comment" in error["details"]["fields"]
    assert set(ApprovalRequest.objects.filter(pk__in=[pk for pk, _ in picks]).values_list("status", flat=True)) \
        == {"pending"}

    with_reason = bulk(approver, "reject", picks, comment="not today")
    assert [row["status"] for row in with_reason.json()["results"]] == ["rejected"] * 3
    assert set(Run.objects.filter(pk__in=[r.run_id for r in three]).values_list("state", flat=True)) \
        == {"CLOSED_REJECTED"}


def test_what_an_approver_may_not_decide_is_refused_item_by_item(three, approver, awaiting, tenant, other_tenant):
    first, second, third = three
    theirs = pending_request(awaiting())
    ApprovalRequest.objects.filter(pk=theirs.pk).update(tenant=other_tenant)  # another tenant's request
    Run.objects.filter(pk=third.run_id).update(submitted_by=approver)  # the approver submitted this run
    response = bulk(approver, "approve", [(first.pk, first.action_digest), (theirs.pk, theirs.action_digest),
                                          (third.pk, third.action_digest), (first.pk, first.action_digest),
                                          (10**9, "0" * 64)])
    assert response.status_code == 200, response.content
    results = response.json()["results"]
    assert [(row["id"], row["decided"]) for row in results] == [
        (first.pk, True), (theirs.pk, False), (third.pk, False), (10**9, False)]  # first named twice, decided once
    assert results[1]["error"]["code"] == "not_found" and results[1]["status"] is None
    assert results[1]["error"]["message"] == results[3]["error"]["message"].replace(str(10**9), str(theirs.pk))
    assert results[2]["error"]["code"] == "denied" and "separation of duties" in results[2]["error"]["message"]
    assert ApprovalRequest.objects.get(pk=theirs.pk).status == "pending"
    assert ApprovalRequest.objects.get(pk=third.pk).status == "pending"
    assert ApprovalRequest.objects.get(pk=second.pk).status == "pending"  # not named


@pytest.mark.parametrize("body, field", [
    ({"decision": "approve", "requests": []}, "requests"),
    ({"decision": "approve", "requests": [{"id": n, "digest": "x"} for n in range(1, 102)]}, "requests"),
    ({"decision": "maybe", "requests": [{"id": 1, "digest": "x"}]}, "decision"),
    ({"decision": "approve", "requests": [{"id": "one", "digest": "x"}]}, "requests"),
    ({"decision": "approve", "requests": [{"id": 1}]}, "requests"),
    ({"decision": "approve", "comment": 3, "requests": [{"id": 1, "digest": "x"}]}, "comment"),
])
def test_a_malformed_batch_is_a_400_envelope_and_decides_nothing(three, approver, body, field):
    response = token_client(approver).post("/api/v1/approvals/bulk", body, format="json")
    assert field in error_of(response, 400, "invalid_input")["details"]["fields"]
    assert not Decision.objects.exists()


def test_an_agent_s_token_may_not_bulk_decide(three, agent):
    response = bulk(agent, "approve", [(request.pk, request.action_digest) for request in three])
    error_of(response, 403, "denied")
    assert not Decision.objects.exists()


def test_the_inbox_form_decides_the_picks_and_reports_each_refusal(three, approver, second_approver):
    first, stale, third = three
    ApprovalRequest.objects.filter(pk=stale.pk).update(action_digest="f" * 64)  # changed since its row was shown
    browser = signed_in(approver, enforce_csrf_checks=False)
    response = browser.post("/approvals/bulk", {
        "verdict": "approve", "comment": "ok",
        "pick": [f"{first.pk}:{first.action_digest}", f"{stale.pk}:{stale.action_digest}",
                 f"{third.pk}:{third.action_digest}", "not-a-pick", "12:"]}, follow=True)
    assert response.status_code == 200
    shown = [str(message) for message in response.context["messages"]]
    assert shown[0] == f"Approved 2 requests: #{first.pk}, #{third.pk}."
    assert shown[1] == f"#{stale.pk} was not decided: the plan changed since you opened it: reload."
    assert shown[2].startswith("#12 was not decided: no approval request 12")
    assert ApprovalRequest.objects.get(pk=stale.pk).status == "pending"
    assert {ApprovalRequest.objects.get(pk=r.pk).status for r in (first, third)} == {"approved"}

    nothing = browser.post("/approvals/bulk", {"verdict": "reject", "comment": "",
                                               "pick": [f"{stale.pk}:{'f' * 64}"]}, follow=True)
    assert [str(m) for m in nothing.context["messages"]] == ["A rejection needs a reason."]
    assert ApprovalRequest.objects.get(pk=stale.pk).status == "pending"


def test_the_inbox_form_needs_csrf_and_an_approver(three, approver, agent):
    first = three[0]
    pick = {"verdict": "approve", "pick": [f"{first.pk}:{first.action_digest}"]}
    assert signed_in(approver, enforce_csrf_checks=True).post("/approvals/bulk", pick).status_code == 403
    assert signed_in(agent, enforce_csrf_checks=False).post("/approvals/bulk", pick).status_code == 403
    assert signed_in(make_user("visitor", first.run.tenant), enforce_csrf_checks=False).post(
        "/approvals/bulk", pick).status_code == 403
    assert ApprovalRequest.objects.get(pk=first.pk).status == "pending"
