"""The OpenAPI schema says what the API does: every operation documents
its error statuses with the envelope, the events page is an object, enums
include the empty value the API returns, and parameters carry the bounds
the views enforce."""

import pytest
from drf_spectacular.generators import SchemaGenerator

from runs.api.schema import READ_ERRORS, WRITE_ERRORS
from runs.statemachine import RunState


@pytest.fixture(scope="module")
def schema():
    return SchemaGenerator().get_schema(request=None, public=True)


def _operations(schema):
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            yield path, method, operation


def test_every_operation_documents_its_errors_as_the_envelope(schema):
    operations = list(_operations(schema))
    assert len(operations) >= 14
    for path, method, operation in operations:
        if path.endswith(("/wait", "/stream")):
            continue  # not DRF views: no 403, 406, 429 (test_waiting_endpoints_are_documented)
        expected = WRITE_ERRORS if method in ("post", "put", "patch") else READ_ERRORS
        for status in expected:
            response = operation["responses"][str(status)]
            assert response["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}, \
                (method, path, status)
    envelope = schema["components"]["schemas"]["ErrorEnvelope"]
    assert set(envelope["required"]) == {"code", "message", "retryable", "source", "details"}


def test_events_page_is_an_object(schema):
    ok = schema["paths"]["/api/v1/runs/{run_id}/events"]["get"]["responses"]["200"]
    assert ok["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/EventPage"}
    page = schema["components"]["schemas"]["EventPage"]
    assert set(page["properties"]) == {"run_id", "events", "last_event_id"}


def test_blank_values_are_in_their_enums(schema):
    components = schema["components"]["schemas"]
    for component, field in (("Run", "closing_cause"), ("RunSummary", "closing_cause"), ("Step", "run_status")):
        refs = {branch["$ref"].rsplit("/", 1)[-1] for branch in components[component]["properties"][field]["oneOf"]}
        assert "BlankEnum" in refs, (component, field)
    assert components["BlankEnum"]["enum"] == [""]


def test_parameters_carry_their_bounds(schema):
    def parameters(path, method="get"):
        return {p["name"]: p["schema"] for p in schema["paths"][path][method].get("parameters", [])}

    runs = parameters("/api/v1/runs")
    assert runs["state"]["enum"] == sorted(RunState.values) or set(runs["state"]["enum"]) == set(RunState.values)
    assert runs["page"]["minimum"] == 1
    events = parameters("/api/v1/runs/{run_id}/events")
    assert events["after"]["minimum"] == 0 and events["wait"]["minimum"] == 0


def test_plan_is_a_non_null_object(schema):
    body = schema["components"]["schemas"]["RunCreate"]["properties"]["plan"]
    assert body["type"] == "object" and not body.get("nullable")
    assert body["required"] == ["steps"] and body["properties"]["steps"]["minItems"] == 1


def test_text_fields_refuse_nul_in_the_schema_without_a_double_match_for_blank(schema):
    title = schema["components"]["schemas"]["RunCreate"]["properties"]["title"]
    assert "oneOf" not in title and title["pattern"] == "^[^\\x00]*$"


def test_waiting_endpoints_are_documented(schema):
    wait = schema["paths"]["/api/v1/runs/{run_id}/wait"]["get"]
    assert {p["name"] for p in wait["parameters"]} == {"run_id", "until", "timeout"}
    assert set(wait["responses"]) == {"200", "400", "401", "404", "500"}
    stream = schema["paths"]["/api/v1/runs/{run_id}/stream"]["get"]
    assert "text/event-stream" in stream["responses"]["200"]["content"]


@pytest.mark.django_db
def test_the_served_schema_is_generated_once_a_process_and_is_the_same_for_every_caller(monkeypatch, tenant, agent):
    from rest_framework.test import APIClient

    from runs.api.views import SchemaView
    from tests.conftest import make_token, make_user

    alice = make_user("alice", tenant, groups=("approvers",))
    monkeypatch.setattr(SchemaView, "_generated", {})
    generated = []
    real = SchemaGenerator.get_schema

    def counting(self, *args, **kwargs):
        generated.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SchemaGenerator, "get_schema", counting)
    answers = []
    for user in (agent, alice, agent):
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {make_token(user)}")
        response = client.get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
        assert response.status_code == 200
        answers.append(response.json())
    assert len(generated) == 1
    assert answers[0] == answers[1] == answers[2]
    assert answers[0] == SchemaGenerator().get_schema(request=None, public=True)
