"""The OpenAPI schema's side of the error contract: every operation documents
the error envelope under each status it can answer with, generated from
the serializer below, so a client (and the fuzzer in the test suite) can
hold the API to it."""

from drf_spectacular.openapi import AutoSchema
from drf_spectacular.utils import OpenApiResponse, extend_schema_serializer
from rest_framework import serializers

from runs.errors import ErrorCode
from runtime.envelopes import ERROR_SOURCES


class ErrorEnvelopeSerializer(serializers.Serializer):
    code = serializers.ChoiceField(choices=ErrorCode.choices)
    message = serializers.CharField()
    retryable = serializers.BooleanField(help_text="true only where the same request can succeed later")
    source = serializers.ChoiceField(choices=sorted(ERROR_SOURCES))
    details = serializers.DictField(help_text="what the message names, machine-readable")


@extend_schema_serializer(many=False, component_name="Error")
class ErrorSerializer(serializers.Serializer):
    error = ErrorEnvelopeSerializer()


ERROR_DESCRIPTIONS = {
    400: "invalid input: a malformed body or parameter, a value no database can store, JSON nested too deep",
    401: "no or invalid credentials",
    403: "authenticated, but not allowed",
    404: "no such resource in the caller's tenant (or no such page)",
    406: "no acceptable representation (the API answers application/json)",
    409: "the resource's state refuses the request",
    413: "the request body is larger than EXECGO_MAX_REQUEST_BYTES",
    415: "the request body is not application/json",
    429: "throttled: retryable after Retry-After seconds",
    500: "a bug (never retryable)",
    503: "the database is unavailable (retryable)",
}
READ_ERRORS = (400, 401, 403, 404, 406, 429, 500, 503)
WRITE_ERRORS = (*READ_ERRORS, 409, 413, 415)


# Text fields refuse NUL (DRF's ProhibitNullCharactersValidator; no database
# stores it): said in the schema too, so generated "valid" input is valid.
NO_NUL_PATTERN = "^[^\\x00]*$"


class ApiAutoSchema(AutoSchema):
    def _map_basic_serializer(self, serializer, direction):
        from runs.api.serializers import StrictSerializer

        schema = super()._map_basic_serializer(serializer, direction)
        if direction == "request" and isinstance(serializer, StrictSerializer):
            schema["additionalProperties"] = False  # it refuses unknown fields
        return schema

    def _insert_field_validators(self, field, schema):
        super()._insert_field_validators(field, schema)
        # After DRF's own: its allow_blank handling would wrap a pattern in a oneOf that "" matches twice.
        if (isinstance(field, serializers.CharField) and not field.read_only and schema.get("type") == "string"
                and "pattern" not in schema and "format" not in schema):
            schema["pattern"] = NO_NUL_PATTERN

    def _get_response_bodies(self, direction="response"):
        responses = super()._get_response_bodies(direction)
        if direction != "response":
            return responses
        for status in WRITE_ERRORS if self.method in ("POST", "PUT", "PATCH") else READ_ERRORS:
            responses.setdefault(str(status), self._get_response_for_code(
                OpenApiResponse(ErrorSerializer, description=ERROR_DESCRIPTIONS[status]), str(status)))
        return dict(sorted(responses.items()))


def _errors(*statuses: int) -> dict:
    return {str(status): {"description": ERROR_DESCRIPTIONS[status],
                          "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
            for status in statuses}


def add_waiting_endpoints(result, generator, request, public):
    """POSTPROCESSING_HOOK: ``runs/{id}/wait`` and ``runs/{id}/stream``
    (runs/api/live.py) answer before Django, so no view describes them;
    their bodies are the Run serializer's component and the error envelope."""
    from runs.api.live import UNTIL

    run_id = {"in": "path", "name": "run_id", "required": True, "schema": {"type": "integer"}}
    common = {"tags": ["runs"], "security": [{"tokenAuth": []}, {"cookieAuth": []}]}
    result["paths"]["/api/v1/runs/{run_id}/wait"] = {"get": {
        **common,
        "operationId": "runs_wait_retrieve",
        "description": "The run as soon as it is in that kind of state (reached: true), or as it is at the timeout "
                       "(reached: false); answers at once for a final run.",
        "parameters": [
            run_id,
            {"in": "query", "name": "until", "schema": {"type": "string", "enum": list(UNTIL), "default": "final"}},
            {"in": "query", "name": "timeout", "schema": {"type": "number", "minimum": 0, "default": 30},
             "description": "seconds; more than EXECGO_API_WAIT_MAX_S (60) waits that long"},
        ],
        "responses": {
            "200": {"description": "", "content": {"application/json": {"schema": {"allOf": [
                {"$ref": "#/components/schemas/Run"},
                {"type": "object", "required": ["reached"], "properties": {"reached": {"type": "boolean"}}},
            ]}}}},
            **_errors(400, 401, 404, 500),
        },
    }}
    result["paths"]["/api/v1/runs/{run_id}/stream"] = {"get": {
        **common,
        "operationId": "runs_stream_retrieve",
        "description": "Server-Sent Events, one per outbox row of the run (id, event = its type, data = the event), "
                       "from Last-Event-ID on; ': keep-alive' comments while quiet; ends after the final state.",
        "parameters": [
            run_id,
            {"in": "header", "name": "Last-Event-ID", "schema": {"type": "string", "pattern": "^[0-9]{1,18}$"}},
            {"in": "query", "name": "last_event_id", "schema": {"type": "integer", "minimum": 0,
                                                                "maximum": 2**63 - 1}},
        ],
        "responses": {"200": {"description": "", "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                      **_errors(400, 401, 404, 500)},
    }}
    return result
