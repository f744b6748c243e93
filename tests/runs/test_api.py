"""REST API v1: shapes, errors as envelopes, tenant isolation, cancel/retry."""

import json

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from runs.models import AuditLog, Job, Run
from runs.pipeline import run_advance
from tests.conftest import make_user, simple_plan, token_client

pytestmark = pytest.mark.django_db

PLAN = simple_plan(["echo", "a"], ["echo", "b"])


def assert_envelope(response, http_status: int, code: str) -> dict:
    assert response.status_code == http_status, response.content
    error = response.json()["error"]
    assert set(error) == {"code", "message", "retryable", "source", "details"}
    assert error["code"] == code
    assert error["message"]
    return error


def test_create_returns_run(api):
    response = api.post("/api/v1/runs", {"title": "hello", "plan": PLAN, "timeout_s": 30}, format="json")
    assert response.status_code == 201
    body = response.json()
    run = Run.objects.get(pk=body["id"])
    assert (body["state"], body["title"], body["timeout_s"], body["retry_of"]) == ("CREATED", "hello", 30, None)
    assert body["job"] == run.job_id
    assert Job.objects.get(pk=run.job_id).status == "pending"
    assert AuditLog.objects.filter(run=run, event="run_created").count() == 1


def test_the_answer_to_a_new_run_reads_no_steps_and_a_replay_reads_them(api):
    # A new run has none until a worker plans it; a replayed key answers with the run as it is now.
    with CaptureQueriesContext(connection) as created:
        response = api.post("/api/v1/runs", {"plan": PLAN}, format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    assert (response.status_code, response.json()["steps"]) == (201, [])
    assert not [query for query in created.captured_queries if 'FROM "runs_step"' in query["sql"]]
    run_advance(response.json()["id"])
    replayed = api.post("/api/v1/runs", {"plan": PLAN}, format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    assert replayed.status_code == 200
    assert [step["id"] for step in replayed.json()["steps"]] == ["s0", "s1"]


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"plan": PLAN, "colour": "red"}, "colour"),
        ({}, "plan"),
        ({"plan": {"steps": []}}, "non-empty"),
        ({"plan": {"steps": [{"id": "a", "tool": "teleport", "params": {}}]}}, "unknown tool"),
        ({"plan": {"steps": [
            {"id": "a", "tool": "shell", "params": {"argv": ["true"]}, "depends_on": ["b"]},
            {"id": "b", "tool": "shell", "params": {"argv": ["true"]}, "depends_on": ["a"]},
        ]}}, "cycle"),
        ({"plan": {"steps": [{"id": "a", "tool": "shell", "params": {"argv": ["true"]}, "depends_on": ["z"]}]}},
         "unknown step"),
        ({"plan": {"steps": [{"id": "a", "tool": "shell", "params": {"argv": ["true"]}},
                             {"id": "a", "tool": "shell", "params": {"argv": ["true"]}}]}}, "duplicate"),
        ({"plan": {"steps": [{"id": "a", "tool": "shell", "params": {}}]}}, "exactly one"),
        ({"plan": {"steps": [{"id": "a", "tool": "shell", "params": {"argv": ["true"]}, "bogus": 1}]}},
         "unknown fields"),
        ({"plan": {"steps": [{"id": "a", "tool": "shell", "params": {"argv": ["true"]}, "timeout_s": -1}]}},
         "timeout_s"),
        ({"plan": PLAN, "timeout_s": "soon"}, "timeout_s"),
        ({"plan": "run everything"}, "plan"),
    ],
)
def test_bad_plans_are_400_envelopes_and_store_nothing(api, body, fragment):
    error = assert_envelope(api.post("/api/v1/runs", body, format="json"), 400, "invalid_input")
    assert fragment in error["message"] or fragment in json.dumps(error["details"])
    assert Run.objects.count() == 0


@pytest.mark.parametrize("raw", ["{not json", "[1, 2]", "null", '"plan"', ""])
def test_malformed_bodies_are_400(api, raw):
    response = api.generic("POST", "/api/v1/runs", raw, content_type="application/json")
    assert_envelope(response, 400, "invalid_input")
    assert Run.objects.count() == 0


def test_ten_megabyte_body_is_413(api):
    big = json.dumps({"plan": PLAN, "title": "x" * (10 * 1024 * 1024)})
    error = assert_envelope(api.generic("POST", "/api/v1/runs", big, content_type="application/json"),
                            413, "invalid_input")
    assert "exceeds" in error["message"]
    assert Run.objects.count() == 0


def test_too_many_steps_is_400(api, settings):
    settings.EXECGO_MAX_PLAN_STEPS = 5
    plan = simple_plan(*[["true"]] * 6)
    error = assert_envelope(api.post("/api/v1/runs", {"plan": plan}, format="json"), 400, "invalid_input")
    assert error["details"] == {"limit": 5}


def test_authentication_is_required():
    anonymous = APIClient()
    assert_envelope(anonymous.get("/api/v1/runs"), 401, "denied")
    wrong = APIClient()
    wrong.credentials(HTTP_AUTHORIZATION="Token not-a-real-token")
    assert_envelope(wrong.post("/api/v1/runs", {"plan": PLAN}, format="json"), 401, "denied")
    assert Run.objects.count() == 0


def test_user_without_tenant_cannot_submit(db):
    from django.contrib.auth.models import User

    loner = User.objects.create_user("loner")
    assert_envelope(token_client(loner).post("/api/v1/runs", {"plan": PLAN}, format="json"), 403, "denied")


def test_list_is_newest_first_filtered_and_paginated(api, make_run):
    created = [make_run("CREATED"), make_run("CLOSED_FAILED"), make_run("SUCCEEDED")]
    body = api.get("/api/v1/runs").json()
    assert [r["id"] for r in body["results"]] == [r.pk for r in reversed(created)]
    assert body["count"] == 3
    assert [r["id"] for r in api.get("/api/v1/runs?state=SUCCEEDED").json()["results"]] == [created[2].pk]
    assert_envelope(api.get("/api/v1/runs?state=DANCING"), 400, "invalid_input")
    assert body["next"] is None
    assert_envelope(api.get("/api/v1/runs?page=9"), 404, "not_found")


def test_other_tenants_runs_are_invisible(api, other_tenant, make_run):
    outsider = token_client(make_user("outsider", other_tenant))
    run = make_run("SUCCEEDED")
    assert outsider.get("/api/v1/runs").json()["count"] == 0
    for method, url in [("get", f"/api/v1/runs/{run.pk}"), ("get", f"/api/v1/runs/{run.pk}/events"),
                        ("post", f"/api/v1/runs/{run.pk}/cancel"), ("post", f"/api/v1/runs/{run.pk}/retry"),
                        ("get", f"/api/v1/jobs/{run.job_id}")]:
        assert_envelope(getattr(outsider, method)(url), 404, "not_found")
    assert Run.objects.count() == 1
    assert not AuditLog.objects.filter(event__in=["cancel_requested", "run_created"]).exists()


def test_idempotency_key_returns_the_same_run(api, tenant, other_tenant):
    first = api.post("/api/v1/runs", {"plan": PLAN}, format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    again = api.post("/api/v1/runs", {"plan": PLAN}, format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    outsider = token_client(make_user("outsider", other_tenant))
    theirs = outsider.post("/api/v1/runs", {"plan": PLAN}, format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    assert theirs.status_code == 201 and theirs.json()["id"] != first.json()["id"]
    assert Run.objects.count() == 2


def test_retry_creates_a_new_run_on_the_same_job(api, make_run):
    old = make_run("CLOSED_FAILED", closing_cause="failed")
    response = api.post(f"/api/v1/runs/{old.pk}/retry")
    assert response.status_code == 201
    new = Run.objects.get(pk=response.json()["id"])
    assert (new.retry_of_id, new.job_id, new.state, new.plan) == (old.pk, old.job_id, "CREATED", old.plan)
    old.refresh_from_db()
    assert old.state == "CLOSED_FAILED"
    job = api.get(f"/api/v1/jobs/{old.job_id}").json()
    assert (job["latest_run"], job["status"]) == (new.pk, "pending")


@pytest.mark.parametrize("state", ["CREATED", "EXECUTING", "TRACING", "FAILED"])
def test_retry_of_a_live_run_is_409(api, make_run, state):
    run = make_run(state)
    assert_envelope(api.post(f"/api/v1/runs/{run.pk}/retry"), 409, "invalid_input")
    assert Run.objects.count() == 1


@pytest.mark.django_db(transaction=True)  # the refusal is audited outside the request's transaction
def test_cancel_of_a_final_run_is_409_and_audited(api, make_run):
    run = make_run("SUCCEEDED")
    assert_envelope(api.post(f"/api/v1/runs/{run.pk}/cancel"), 409, "invalid_input")
    refused = AuditLog.objects.get(run=run, event="cancel_refused")
    assert refused.actor.username == "agent"
    run.refresh_from_db()
    assert (run.state, run.cancel_requested_at) == ("SUCCEEDED", None)


def test_events_cursor_must_be_a_number(api, make_run):
    run = make_run("CREATED")
    assert_envelope(api.get(f"/api/v1/runs/{run.pk}/events?after=abc"), 400, "invalid_input")
    assert_envelope(api.get(f"/api/v1/runs/{run.pk}/events?after=-1"), 400, "invalid_input")


def test_unknown_run_is_404_envelope(api):
    assert_envelope(api.get("/api/v1/runs/999999"), 404, "not_found")


def test_openapi_schema_and_docs(api, client):
    schema = api.get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    paths = json.loads(schema.content)["paths"]
    assert {"/api/v1/runs", "/api/v1/runs/{run_id}/cancel", "/api/v1/runs/{run_id}/events",
            "/api/v1/jobs/{job_id}"} <= set(paths)
    docs = api.get("/api/v1/docs/")
    assert docs.status_code == 200 and b"swagger" in docs.content.lower()


@pytest.mark.django_db(transaction=True)
def test_cancel_before_execution_is_applied_at_the_first_cancellable_state(api, agent):
    run_id = api.post("/api/v1/runs", {"plan": PLAN}, format="json").json()["id"]
    response = api.post(f"/api/v1/runs/{run_id}/cancel")
    assert response.status_code == 202
    assert response.json()["cancel_requested_at"] is not None
    run_advance(run_id)
    run = Run.objects.get(pk=run_id)
    assert (run.state, run.closing_cause) == ("CLOSED_CANCELLED", "cancelled")
    assert list(run.steps.values_list("status", flat=True)) == ["skipped", "skipped"]
    cancelled = AuditLog.objects.get(run=run, event="run_cancelled")
    assert cancelled.actor == agent


@pytest.mark.django_db(transaction=True)
def test_cancel_while_awaiting_approval_applies_at_once(api, make_run, agent):
    run = make_run("AWAITING_HITL", previous_state="POLICY_CHECK")
    assert api.post(f"/api/v1/runs/{run.pk}/cancel").status_code == 202
    run.refresh_from_db()
    assert run.state == "CLOSED_CANCELLED"
    assert list(AuditLog.objects.filter(run=run).values_list("event", flat=True)) == [
        "cancel_requested", "state_changed", "state_changed", "run_cancelled",
    ]


@pytest.mark.django_db(transaction=True)
def test_cancel_before_policy_check_applies_when_the_run_reaches_approval(api, agent, seeded_policy):
    plan = simple_plan(["pip", "install", "requests"])  # high risk: the run would wait for an approver
    run_id = api.post("/api/v1/runs", {"plan": plan}, format="json").json()["id"]
    assert api.post(f"/api/v1/runs/{run_id}/cancel").status_code == 202
    run_advance(run_id)
    run = Run.objects.get(pk=run_id)
    assert (run.state, run.closing_cause) == ("CLOSED_CANCELLED", "cancelled")
    states = list(run.traces.filter(kind="transition").values_list("to_state", flat=True))
    assert states[-4:] == ["AWAITING_HITL", "CANCELLED", "TRACING", "CLOSED_CANCELLED"]
    assert AuditLog.objects.get(run=run, event="run_cancelled").actor == agent
