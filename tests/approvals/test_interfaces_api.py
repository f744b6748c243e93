"""The approvals' REST API, through DRF's test client: an approver's token
lists and reads the tenant's requests, approves, and rejects with a
comment; agents, submitters, replays, GETs, sessions without a CSRF token
and anonymous calls are refused with the error envelope and change
nothing; and the OpenAPI schema documents the paths and their bodies."""

import json
import re

import pytest
from rest_framework.test import APIClient

from approvals.models import ApprovalRequest, ApprovalStatus, Decision
from runs.models import Run
from tests.approvals.interfaces_helpers import (
    PACKAGE_INSTALL_REASON,
    add_shell_steps,
    error_of,
    rated_approval,
    run_of,
    signed_in,
    snapshot,
    submitted_by,
    waiting_run,
)
from tests.conftest import make_user, open_approval, token_client

pytestmark = pytest.mark.django_db


# --- API: list and read -----------------------------------------------------------


def test_an_approvers_token_lists_the_tenants_requests_by_status(make_run, alice, bob, outsider):
    first = open_approval(waiting_run(make_run))
    second = open_approval(waiting_run(make_run))
    decided = open_approval(waiting_run(make_run))
    theirs = open_approval(run_of(outsider.membership.tenant, outsider))
    api = token_client(alice)
    assert token_client(bob).post(f"/api/v1/approvals/{decided.pk}/approve", {"digest": decided.action_digest}, format="json").status_code == 200

    response = api.get("/api/v1/approvals?status=pending")
    assert response.status_code == 200, response.content
    assert [row["id"] for row in response.json()] == [second.pk, first.pk]
    assert {row["status"] for row in response.json()} == {"pending"}

    response = api.get("/api/v1/approvals?status=decided")
    assert response.status_code == 200, response.content
    assert [(row["id"], row["status"]) for row in response.json()] == [(decided.pk, "approved")]
    assert [(row["decider"], row["decision"]) for row in response.json()[0]["decisions"]] == [("bob", "approve")]

    everything = api.get("/api/v1/approvals").json()
    assert [row["id"] for row in everything] == [decided.pk, second.pk, first.pk]
    assert theirs.pk not in {row["id"] for row in everything}
    assert [row["id"] for row in token_client(outsider).get("/api/v1/approvals").json()] == [theirs.pk]

    error = error_of(api.get("/api/v1/approvals?status=granted"), 400, "invalid_input")
    assert "status" in error["details"]["fields"], error
    assert "granted" in error["message"], error


def test_an_approvers_token_reads_one_request(make_run, alice):
    approval = open_approval(waiting_run(make_run), approvals_required=2)
    response = token_client(alice).get(f"/api/v1/approvals/{approval.pk}")
    assert response.status_code == 200, response.content
    body = response.json()
    assert {"id", "run_id", "status", "risk", "action_digest", "approvals_required", "approvals", "steps",
            "decisions", "page_url"} <= set(body)
    approval.refresh_from_db()
    assert (body["id"], body["run_id"], body["status"], body["risk"], body["action_digest"],
            body["approvals_required"], body["approvals"], body["steps"], body["decisions"], body["page_url"]) == (
        approval.pk, approval.run_id, "pending", "high", approval.action_digest, 2, 0, approval.steps, [],
        f"/approvals/{approval.pk}/")
    assert re.fullmatch(r"[0-9a-f]{64}", body["action_digest"])


def test_the_read_shows_the_steps_and_the_decisions_so_far(seeded_policy, make_run, alice):
    run = waiting_run(make_run)
    add_shell_steps(run, ["echo", "hi"], ["pip", "install", "requests"])
    approval = rated_approval(run)
    ApprovalRequest.objects.filter(pk=approval.pk).update(approvals_required=2)
    api = token_client(alice)
    response = api.post(f"/api/v1/approvals/{approval.pk}/approve", {"digest": approval.action_digest, "comment": "fine by me"}, format="json")
    assert response.status_code == 200, response.content

    body = api.get(f"/api/v1/approvals/{approval.pk}").json()
    assert (body["status"], body["approvals"], body["approvals_required"]) == ("pending", 1, 2)
    assert [(row["decider"], row["decision"], row["comment"]) for row in body["decisions"]] == [
        ("alice", "approve", "fine by me")]
    assert [(step["action"]["argv"], step["risk"]) for step in body["steps"]] == [
        (["echo", "hi"], "low"), (["pip", "install", "requests"], "high")]
    assert PACKAGE_INSTALL_REASON in body["steps"][1]["reasons"]
    assert Run.objects.get(pk=run.pk).state == "AWAITING_HITL"


# --- API: decisions --------------------------------------------------------------------


def test_an_approvers_token_approves_and_the_run_executes(pending, alice):
    response = token_client(alice).post(f"/api/v1/approvals/{pending.pk}/approve", {"digest": pending.action_digest, "comment": "go"}, format="json")
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["id"], body["status"], body["approvals"]) == (pending.pk, "approved", 1)
    assert body["decided_at"] is not None
    assert Run.objects.get(pk=pending.run_id).state == "EXECUTING"
    assert list(Decision.objects.filter(request=pending).values_list("decider__username", "decision", "comment")) == [
        ("alice", "approve", "go")]


def test_an_approvers_token_rejects_with_a_comment_and_the_run_closes(pending, alice):
    response = token_client(alice).post(f"/api/v1/approvals/{pending.pk}/reject", {"digest": pending.action_digest, "comment": "  not today  "},
                                        format="json")
    assert response.status_code == 200, response.content
    assert response.json()["status"] == "rejected"
    assert Run.objects.get(pk=pending.run_id).state == "CLOSED_REJECTED"
    assert list(Decision.objects.filter(request=pending).values_list("decider__username", "decision", "comment")) == [
        ("alice", "reject", "not today")]


@pytest.mark.parametrize("payload", [{}, {"comment": ""}, {"comment": "   "}])
def test_a_reject_without_a_comment_is_a_400(pending, alice, payload):
    before = snapshot(pending)
    body = {**payload, "digest": pending.action_digest}
    error = error_of(token_client(alice).post(f"/api/v1/approvals/{pending.pk}/reject", body, format="json"),
                     400, "invalid_input")
    assert "comment" in error["details"]["fields"], error
    assert snapshot(pending) == before
    assert before[:3] == ("pending", None, "AWAITING_HITL")


@pytest.mark.parametrize("groups", [("agents",), ("agents", "approvers"), ()],
                         ids=["agent", "agent-in-approvers", "no-group"])
def test_an_agents_token_gets_403_on_every_endpoint(tenant, pending, groups):
    agent_api = token_client(make_user("bot", tenant, groups=groups))
    before = snapshot(pending)
    for method, url, payload in (
        ("get", "/api/v1/approvals", None),
        ("get", f"/api/v1/approvals/{pending.pk}", None),
        ("post", f"/api/v1/approvals/{pending.pk}/approve", {"digest": pending.action_digest, "comment": "self-approved"}),
        ("post", f"/api/v1/approvals/{pending.pk}/reject", {"digest": pending.action_digest, "comment": "self-rejected"}),
        ("post", "/api/v1/approvals/bulk", {"decision": "approve", "items": [{"id": pending.pk,
                                                                              "digest": pending.action_digest}]}),
        ("get", "/api/v1/approvals/grants", None),
        ("post", "/api/v1/approvals/grants/1/revoke", {"comment": "not mine"}),
    ):
        response = getattr(agent_api, method)(url, payload, format="json") if payload else agent_api.get(url)
        error_of(response, 403, "denied")
    assert snapshot(pending) == before
    assert not Decision.objects.exists()


def test_the_submitter_may_not_approve_its_own_run(make_run, alice):
    approval = open_approval(submitted_by(waiting_run(make_run), alice))
    before = snapshot(approval)
    error = error_of(token_client(alice).post(f"/api/v1/approvals/{approval.pk}/approve", {"digest": approval.action_digest}, format="json"),
                     403, "denied")
    assert "separation of duties" in error["message"], error
    assert snapshot(approval) == before
    assert not Decision.objects.exists()


def test_a_replayed_approval_on_a_quorum_request_is_a_409(make_run, alice, bob):
    approval = open_approval(waiting_run(make_run), approvals_required=2)
    api = token_client(alice)
    first = api.post(f"/api/v1/approvals/{approval.pk}/approve", {"digest": approval.action_digest}, format="json")
    assert first.status_code == 200, first.content
    assert (first.json()["status"], first.json()["approvals"]) == ("pending", 1)

    before = snapshot(approval)
    error = error_of(api.post(f"/api/v1/approvals/{approval.pk}/approve", {"digest": approval.action_digest}, format="json"), 409, "invalid_input")
    assert "already decided" in error["message"], error
    error_of(api.post(f"/api/v1/approvals/{approval.pk}/reject", {"digest": approval.action_digest, "comment": "changed my mind"}, format="json"),
             409, "invalid_input")
    assert snapshot(approval) == before
    assert Decision.objects.filter(request=approval).count() == 1

    second = token_client(bob).post(f"/api/v1/approvals/{approval.pk}/approve", {"digest": approval.action_digest}, format="json")
    assert (second.status_code, second.json()["status"], second.json()["approvals"]) == (200, "approved", 2)
    assert Run.objects.get(pk=approval.run_id).state == "EXECUTING"


def test_a_second_approval_of_an_approved_request_is_a_409(tenant, pending, alice, bob):
    assert token_client(alice).post(f"/api/v1/approvals/{pending.pk}/approve", {"digest": pending.action_digest}, format="json").status_code == 200
    before = snapshot(pending)
    assert before[0] == "approved"
    error = error_of(token_client(bob).post(f"/api/v1/approvals/{pending.pk}/approve", {"digest": pending.action_digest}, format="json"),
                     409, "invalid_input")
    assert error["details"]["status"] == "approved", error
    error_of(token_client(bob).post(f"/api/v1/approvals/{pending.pk}/reject", {"digest": pending.action_digest, "comment": "too late"},
                                    format="json"), 409, "invalid_input")
    assert snapshot(pending) == before
    assert Decision.objects.filter(request=pending).count() == 1


@pytest.mark.parametrize("verdict", ["approve", "reject"])
def test_a_decision_by_get_is_a_405(pending, alice, verdict):
    before = snapshot(pending)
    error = error_of(token_client(alice).get(f"/api/v1/approvals/{pending.pk}/{verdict}"), 405, "invalid_input")
    assert "GET" in error["message"], error
    assert snapshot(pending) == before


def test_a_session_decision_without_a_csrf_token_is_a_403(pending, alice):
    client = signed_in(alice, APIClient, enforce_csrf_checks=True)
    assert client.get(f"/api/v1/approvals/{pending.pk}").status_code == 200  # a session reads
    before = snapshot(pending)
    for verdict in ("approve", "reject"):
        error = error_of(client.post(f"/api/v1/approvals/{pending.pk}/{verdict}", {"comment": "csrf"},
                                     format="json"), 403, "denied")
        assert "CSRF" in error["message"], error
    assert snapshot(pending) == before
    assert not Decision.objects.exists()

    # The same session with the token it was given decides.
    assert client.get(f"/approvals/{pending.pk}/").status_code == 200
    token = client.cookies["csrftoken"].value
    response = client.post(f"/api/v1/approvals/{pending.pk}/approve", {"digest": pending.action_digest}, format="json", HTTP_X_CSRFTOKEN=token)
    assert (response.status_code, response.json()["status"]) == (200, "approved")


def test_anonymous_api_calls_are_401(pending):
    for url in ("/api/v1/approvals", f"/api/v1/approvals/{pending.pk}"):
        error_of(APIClient().get(url), 401, "denied")
    error_of(APIClient().post(f"/api/v1/approvals/{pending.pk}/approve", {"digest": pending.action_digest}, format="json"), 401, "denied")
    assert not Decision.objects.exists()


# --- OpenAPI -------------------------------------------------------------------------------------


def test_the_openapi_schema_documents_the_approvals_paths(alice):
    response = signed_in(alice).get("/api/v1/schema/?format=json")
    assert response.status_code == 200, response.content[:500]
    paths = json.loads(response.content)["paths"]
    documented = {(path, method) for path, operations in paths.items() if path.startswith("/api/v1/approvals")
                  for method in operations if method in ("get", "post", "put", "patch", "delete")}
    assert documented == {
        ("/api/v1/approvals", "get"),
        ("/api/v1/approvals/bulk", "post"),
        ("/api/v1/approvals/grants", "get"),
        ("/api/v1/approvals/grants/{grant_id}/revoke", "post"),
        ("/api/v1/approvals/{request_id}", "get"),
        ("/api/v1/approvals/{request_id}/approve", "post"),
        ("/api/v1/approvals/{request_id}/reject", "post"),
    }
    status = next(param for param in paths["/api/v1/approvals"]["get"]["parameters"] if param["name"] == "status")
    assert set(status["schema"]["enum"]) == {*ApprovalStatus.values, "decided"}
    for verdict in ("approve", "reject"):
        assert "requestBody" in paths[f"/api/v1/approvals/{{request_id}}/{verdict}"]["post"]


def test_the_schema_documents_the_reject_body_without_edits(alice):
    schema = signed_in(alice).get("/api/v1/schema/?format=json").json()

    def body_properties(path: str) -> set[str]:
        ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        return set(schema["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"])

    assert "edits" in body_properties("/api/v1/approvals/{request_id}/approve")
    assert body_properties("/api/v1/approvals/{request_id}/reject") == {"comment", "digest"}
