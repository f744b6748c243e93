"""The waiting endpoints (``runs/{id}/wait``, ``runs/{id}/stream``) are
Channels consumers in front of Django: their errors are the same envelope,
checked over real HTTP against Daphne."""

import httpx
import pytest

from tests.api.test_error_contract import ENVELOPE_KEYS
from tests.conftest import make_token

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def http(api_server, agent):
    token = make_token(agent)
    with httpx.Client(base_url=api_server.url, headers={"Authorization": f"Token {token}"},
                      timeout=20, trust_env=False) as client:
        yield client


def assert_envelope(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == ENVELOPE_KEYS
    assert (error["code"], error["retryable"]) == (code, False)
    return error


@pytest.mark.parametrize("endpoint", ["wait", "stream"])
def test_waiting_endpoints_refuse_with_envelopes(http, make_run, endpoint):
    run = make_run("SUCCEEDED", closing_cause="succeeded")
    path = f"/api/v1/runs/{run.pk}/{endpoint}"
    assert_envelope(httpx.get(http.base_url.join(path), trust_env=False), 401, "denied")
    assert_envelope(http.get(path, headers={"Authorization": "Token not-a-key!"}), 401, "denied")
    response = http.post(path)
    assert_envelope(response, 405, "invalid_input")
    assert response.headers["allow"] == "GET"
    assert_envelope(http.get(f"/api/v1/runs/{run.pk + 1000}/{endpoint}"), 404, "not_found")
    assert_envelope(http.get(f"/api/v1/runs/not-a-number/{endpoint}"), 404, "not_found")


@pytest.mark.parametrize("query", ["until=soon", "until=", "timeout=", "timeout=nan", "timeout=-1", "timeout=inf", "timeout=abc",
                                   "timeout=1e999"])
def test_wait_refuses_bad_parameters(http, make_run, query):
    run = make_run("SUCCEEDED", closing_cause="succeeded")
    assert_envelope(http.get(f"/api/v1/runs/{run.pk}/wait?{query}"), 400, "invalid_input")


def test_wait_answers_a_final_run(http, make_run):
    run = make_run("SUCCEEDED", closing_cause="succeeded")
    body = http.get(f"/api/v1/runs/{run.pk}/wait?timeout=0").json()
    assert (body["id"], body["reached"], body["state"]) == (run.pk, True, "SUCCEEDED")


@pytest.mark.parametrize("last_event_id", ["", "x", "-1", "1.5", str(2**63), "9" * 40, "%00"])
def test_stream_refuses_a_bad_cursor(http, make_run, last_event_id):
    run = make_run("SUCCEEDED", closing_cause="succeeded")
    assert_envelope(http.get(f"/api/v1/runs/{run.pk}/stream?last_event_id={last_event_id}"), 400, "invalid_input")


# --- the same contract over real HTTP, where Daphne and Django's ASGI handler
# read the request before any view does ----------------------------------------

def test_over_http_unrouted_paths_are_json_404s(http):
    for path in ("/api/v1/", "/api/v1/runs/not-a-number", "/api/nothing"):
        assert_envelope(http.get(path), 404, "not_found")


def test_over_http_a_multipart_body_without_boundary_is_415(http):
    response = http.post("/api/v1/runs", content=b"--x\r\n\r\n", headers={"Content-Type": "multipart/form-data"})
    assert_envelope(response, 415, "invalid_input")


def test_over_http_an_oversize_body_is_413(http):
    from django.conf import settings

    body = b'{"title": "' + b"x" * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 10) + b'"}'
    response = http.post("/api/v1/runs", content=body, headers={"Content-Type": "application/json"})
    assert_envelope(response, 413, "invalid_input")


def test_over_http_deep_json_is_400(http):
    body = b"[" * 100_000 + b"]" * 100_000
    response = http.post("/api/v1/runs", content=body, headers={"Content-Type": "application/json"})
    assert_envelope(response, 400, "invalid_input")
