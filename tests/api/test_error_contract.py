"""The API's error contract: every answer under /api/ is the error envelope
(docs/data-plane.md#error-envelope) with the right status, strings no
database can store are a 400 (never a retryable 500), and bodies are
bounded before they are decoded."""

import json

import pytest
from django.conf import settings
from rest_framework.test import APIClient

from runs.models import Run, Step
from tests.conftest import simple_plan

pytestmark = pytest.mark.django_db

ENVELOPE_KEYS = {"code", "message", "retryable", "source", "details"}


def assert_envelope(response, http_status: int, code: str, *, retryable: bool = False) -> dict:
    assert response.status_code == http_status, response.content[:500]
    assert response["Content-Type"] == "application/json", response["Content-Type"]
    error = json.loads(response.content)["error"]
    assert set(error) == ENVELOPE_KEYS
    assert (error["code"], error["retryable"]) == (code, retryable)
    assert error["message"]
    return error


def post_json(api, path: str, raw: str | bytes, **extra):
    return api.generic("POST", path, raw, content_type="application/json", **extra)


def shell_plan(argv: list[str], step_id: str = "a") -> dict:
    return {"steps": [{"id": step_id, "tool": "shell", "params": {"argv": argv}}]}


# --- the five inputs that were retryable 500s -------------------------------

UNSTORABLE_BODIES = {
    "NUL in a step id": json.dumps({"plan": shell_plan(["true"], step_id="a\u0000")}),
    "lone surrogate in argv": '{"plan": {"steps": [{"id": "a", "tool": "shell", "params": {"argv": ["\\ud800"]}}]}}',
    "NUL in file content": json.dumps({"plan": {"steps": [{"id": "w", "tool": "file", "params": {
        "op": "write", "path": "out.txt", "content": "x\u0000y"}}]}}),
    "NUL in the title": json.dumps({"title": "a\u0000", "plan": shell_plan(["true"])}),
    "NUL in a key": json.dumps({"plan": {"steps": [{"id": "a", "tool": "shell", "params": {
        "argv": ["true"], "env": {"A\u0000": "1"}}}]}}),
    "lone low surrogate in the goal": '{"planner": "llm", "goal": "\\udc00"}',
}


@pytest.mark.parametrize("raw", UNSTORABLE_BODIES.values(), ids=UNSTORABLE_BODIES.keys())
def test_unstorable_strings_are_400_and_store_nothing(api, raw):
    error = assert_envelope(post_json(api, "/api/v1/runs", raw), 400, "invalid_input")
    assert "cannot be stored" in error["message"]
    assert Run.objects.count() == 0


@pytest.mark.parametrize("depth", [65, 1000, 50_000, 100_000])
def test_deep_json_is_400_before_decoding(api, depth):
    for raw in ("[" * depth + "]" * depth, '{"plan": ' + '{"a": ' * depth + "1" + "}" * depth + "}"):
        error = assert_envelope(post_json(api, "/api/v1/runs", raw), 400, "invalid_input")
        assert error["details"] == {"max_depth": settings.EXECGO_API_MAX_JSON_DEPTH}
    assert Run.objects.count() == 0


def test_brackets_inside_strings_are_not_nesting(api):
    title = "[" * 100 + '\\"{' * 50
    response = post_json(api, "/api/v1/runs", '{"title": "' + title + '", "plan": '
                         + json.dumps(shell_plan(["echo", "]]]"])) + "}")
    assert response.status_code == 201, response.content
    assert Run.objects.get().title == "[" * 100 + '"{' * 50


def test_unstorable_strings_on_other_endpoints(api, make_run):
    assert_envelope(post_json(api, "/api/v1/policy/evaluate", '{"plan": {"steps": [{"id": "\\u0000"}]}}'),
                    400, "invalid_input")
    run = make_run("CREATED")
    Step.objects.create(run=run, step_id="a", position=0, tool="shell", timeout_s=5)
    response = api.get(f"/api/v1/runs/{run.pk}/steps/a%00/logs/stdout")
    assert_envelope(response, 404, "not_found")
    assert_envelope(api.post("/api/v1/runs", {"plan": shell_plan(["true"])}, format="json",
                             HTTP_IDEMPOTENCY_KEY="k\u0000"), 400, "invalid_input")
    assert Run.objects.count() == 1


def test_a_token_with_a_nul_is_401_not_a_query(db):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token abc\u0000def")
    assert_envelope(client.get("/api/v1/runs"), 401, "denied")


# --- sizes -------------------------------------------------------------------

def test_oversize_body_is_413(api):
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    big = json.dumps({"plan": shell_plan(["true"]), "title": "x" * limit})
    error = assert_envelope(post_json(api, "/api/v1/runs", big), 413, "invalid_input")
    assert error["details"] == {"limit_bytes": limit}
    assert Run.objects.count() == 0


def test_a_body_at_the_limit_is_read(api, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 4096
    body = json.dumps({"plan": shell_plan(["true"]), "title": "t"})
    body = body[:-1] + " " * (4096 - len(body)) + "}"
    assert len(body) == 4096
    assert post_json(api, "/api/v1/runs", body).status_code == 201
    assert_envelope(post_json(api, "/api/v1/runs", body + " "), 413, "invalid_input")


# --- statuses Django or DRF answer by themselves ------------------------------

@pytest.mark.parametrize("path", [
    "/api/v1/runs/not-a-number", "/api/v1/", "/api/", "/api", "/api/v2/runs", "/api/v1/runs/1/nothing",
    "/api/v1/runs/-1", "/api/v1/runs/1/wait/extra", "/api/v1/schema", "/api/v1/%00",
])
@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
def test_unrouted_api_paths_are_404_envelopes(api, path, method):
    error = assert_envelope(api.generic(method, path), 404, "not_found")
    assert error["source"] == "api"


def test_unrouted_paths_outside_the_api_stay_html(db, client):
    response = client.get("/no-such-page/")
    assert response.status_code in (302, 404)
    assert not response["Content-Type"].startswith("application/json")


def test_405_envelope_names_allowed_methods(api, make_run):
    run = make_run("CREATED")
    response = api.delete(f"/api/v1/runs/{run.pk}")
    assert_envelope(response, 405, "invalid_input")
    assert "GET" in response["Allow"] and "DELETE" not in response["Allow"]


def test_415_envelope(api):
    response = api.generic("POST", "/api/v1/runs", "plan=x", content_type="application/x-www-form-urlencoded")
    assert_envelope(response, 415, "invalid_input")


def test_multipart_without_boundary_is_an_envelope(api):
    response = api.generic("POST", "/api/v1/runs", b"--x\r\n", content_type="multipart/form-data")
    assert_envelope(response, 415, "invalid_input")


def test_406_envelope(api):
    assert_envelope(api.get("/api/v1/runs", HTTP_ACCEPT="application/xml"), 406, "invalid_input")


@pytest.mark.parametrize("raw", ["{not json", "[1, 2]", "null", '"plan"', "NaN", '{"plan": Infinity}',
                                 b'{"title": "\xff"}'])
def test_parse_errors_are_400_envelopes(api, raw):
    assert_envelope(post_json(api, "/api/v1/runs", raw), 400, "invalid_input")
    assert Run.objects.count() == 0


def test_unauthenticated_is_401_envelope(db):
    response = APIClient().get("/api/v1/runs")
    assert_envelope(response, 401, "denied")
    assert response["WWW-Authenticate"] == "Token"


def test_throttled_is_429_retryable_with_retry_after(api, monkeypatch):
    from django.core.cache import cache
    from rest_framework.throttling import UserRateThrottle

    cache.clear()
    monkeypatch.setitem(UserRateThrottle.THROTTLE_RATES, "user", "3/minute")
    statuses = [api.get("/api/v1/runs").status_code for _ in range(3)]
    response = api.get("/api/v1/runs")
    cache.clear()
    assert statuses == [200, 200, 200]
    assert_envelope(response, 429, "external_failure", retryable=True)
    assert 1 <= int(response["Retry-After"]) <= 60


# --- parameters the schema promises -----------------------------------------

@pytest.mark.parametrize("query", ["page=garbage", "page=0", "page=-1", "page=1.5", "page=last", "page=%D9%A3",
                                   "state=RUNNING", "state="])
def test_bad_list_parameters_are_400(api, query):
    assert_envelope(api.get(f"/api/v1/runs?{query}"), 400, "invalid_input")


def test_page_past_the_end_is_404(api, make_run):
    make_run("CREATED")
    assert api.get("/api/v1/runs?page=1").json()["count"] == 1
    assert_envelope(api.get("/api/v1/runs?page=2"), 404, "not_found")


@pytest.mark.parametrize("query", ["after=-1", "after=x", "wait=-5", "after=%D9%A3", "after=1_000", "after=",
                                   "wait=", f"after={2**63}", "after=" + "9" * 5000])
def test_bad_event_cursors_are_400(api, make_run, query):
    run = make_run("CREATED")
    assert_envelope(api.get(f"/api/v1/runs/{run.pk}/events?{query}"), 400, "invalid_input")


def test_events_response_is_the_documented_object(api, make_run):
    run = make_run("CREATED")
    body = api.get(f"/api/v1/runs/{run.pk}/events?after=0").json()
    assert set(body) == {"run_id", "events", "last_event_id"}
    assert body["run_id"] == run.pk


@pytest.mark.parametrize("plan", [None, [], "x", 1])
def test_a_plan_that_is_not_an_object_is_400(api, plan):
    error = assert_envelope(api.post("/api/v1/runs", {"plan": plan}, format="json"), 400, "invalid_input")
    assert "plan" in error["message"]


def test_huge_path_ids_are_404(api):
    assert_envelope(api.get("/api/v1/runs/99999999999999999999999"), 404, "not_found")
    assert_envelope(api.get("/api/v1/jobs/99999999999999999999999"), 404, "not_found")


def test_a_valid_submission_still_works(api):
    response = api.post("/api/v1/runs", {"plan": simple_plan(["echo", "é"])}, format="json",
                        HTTP_IDEMPOTENCY_KEY="key-1")
    assert response.status_code == 201, response.content
    assert Run.objects.get().plan["steps"][0]["params"]["argv"] == ["echo", "é"]


@pytest.mark.parametrize("field, value", [("goal", 0), ("title", 5), ("title", True), ("timeout_s", "60"),
                                          ("timeout_s", 1.5), ("timeout_s", True), ("callback_events", "final"),
                                          ("callback_events", [1]), ("planner", 1)])
def test_values_of_another_json_type_are_400(api, field, value):
    body = {"plan": shell_plan(["true"]), field: value}
    error = assert_envelope(api.post("/api/v1/runs", body, format="json"), 400, "invalid_input")
    assert field in error["details"]["fields"]
    assert Run.objects.count() == 0


def test_a_planner_plan_with_a_nul_is_refused_by_validate_plan():
    from runs.errors import ExecGoError
    from runs.plan_schema import validate_plan

    with pytest.raises(ExecGoError) as refused:
        validate_plan({"steps": [{"id": "a", "tool": "shell", "params": {"script": "echo \u0000"}}]})
    assert refused.value.envelope["code"] == "invalid_input"
    assert refused.value.envelope["details"] == {"path": "plan.steps[0].params.script"}


def test_unstorable_comment_on_the_approvals_api_is_400(tenant, agent, make_run):
    from approvals.models import ApprovalRequest
    from tests.conftest import make_user, open_approval, token_client

    approval = open_approval(make_run("AWAITING_HITL"))
    approver = token_client(make_user("bob", tenant, groups=("approvers",)))
    for body in ('{"comment": "no\\u0000"}', '{"comment": "ok", "edits": {"a": {"argv": ["\\udfff"]}}}'):
        assert_envelope(post_json(approver, f"/api/v1/approvals/{approval.pk}/approve", body), 400, "invalid_input")
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "pending"


def test_callback_url_with_a_nul_is_400(api, settings):
    settings.EXECGO_CALLBACK_ALLOWED_HOSTS = ["hooks.example.com"]
    raw = json.dumps({"plan": shell_plan(["true"]), "callback_url": "https://hooks.example.com/\u0000"})
    assert_envelope(post_json(api, "/api/v1/runs", raw), 400, "invalid_input")
    assert Run.objects.count() == 0


def test_approvals_api_holds_to_its_schema(tenant, agent, make_run):
    from approvals.models import ApprovalRequest
    from tests.conftest import make_user, open_approval, token_client

    approval = open_approval(make_run("AWAITING_HITL"))
    approver = token_client(make_user("carol", tenant, groups=("approvers",)))
    assert_envelope(approver.get("/api/v1/approvals?status="), 400, "invalid_input")
    for verb in ("approve", "reject"):
        response = approver.post(f"/api/v1/approvals/{approval.pk}/{verb}", {"comment": 0}, format="json")
        assert_envelope(response, 400, "invalid_input")
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "pending"


def test_request_bodies_refuse_unknown_fields_in_the_schema():
    from drf_spectacular.generators import SchemaGenerator

    components = SchemaGenerator().get_schema(request=None, public=True)["components"]["schemas"]
    assert components["RunCreate"]["additionalProperties"] is False
    assert components["PlanEvaluate"]["additionalProperties"] is False


@pytest.mark.parametrize("raw", ['{"title": "' + '\\"' * 400_000, '"' * 900_000, '["' + "\\" * 900_000])
def test_depth_count_stays_linear_on_unterminated_strings(api, raw):
    """A scan that retried a failed string match from every later quote took
    14 s for 80 kB of escaped quotes (hours for the body limit)."""
    import time

    started = time.monotonic()
    assert_envelope(post_json(api, "/api/v1/runs", raw), 400, "invalid_input")
    assert time.monotonic() - started < 10  # generous: linear takes well under a second
