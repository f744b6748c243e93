"""The REST API's framework settings: Django REST framework's
REST_FRAMEWORK and drf-spectacular's SPECTACULAR_SETTINGS.

They wire in the API's own classes (``runs/api/``): the strict token
authentication and JSON parser, the error envelope, the schema's additions.
The figures an operator may change (the throttle rate, the size and depth
limits, the long-poll caps) stay in ``execgo/settings.py``.
"""

from typing import Any


def rest_framework(*, throttle_rate: str | None) -> dict[str, Any]:
    """REST_FRAMEWORK; ``throttle_rate`` in DRF's syntax, None: no throttling."""
    return {
        "DEFAULT_AUTHENTICATION_CLASSES": [
            "runs.api.authentication.StrictTokenAuthentication",
            "rest_framework.authentication.SessionAuthentication",
        ],
        "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
        "DEFAULT_PARSER_CLASSES": ["runs.api.parsers.StrictJSONParser"],
        # JSON only: an error is the envelope whatever the Accept header (the
        # browsable API would answer HTML); the docs are at /api/v1/docs/.
        "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
        "DEFAULT_SCHEMA_CLASS": "runs.api.schema.ApiAutoSchema",
        "DEFAULT_PAGINATION_CLASS": "runs.api.pagination.StrictPageNumberPagination",
        "PAGE_SIZE": 50,
        "DEFAULT_THROTTLE_CLASSES": ["rest_framework.throttling.UserRateThrottle"] if throttle_rate else [],
        "DEFAULT_THROTTLE_RATES": {"user": throttle_rate},
        "EXCEPTION_HANDLER": "runs.api.errors.exception_handler",
        "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
    }


def api_schema() -> dict[str, Any]:
    """SPECTACULAR_SETTINGS: the OpenAPI schema and its documentation pages."""
    return {
        "TITLE": "ExecGo API",
        "DESCRIPTION": "Submit runs of tool calls, watch them, cancel and retry them.",
        "VERSION": "1",
        "SERVE_INCLUDE_SCHEMA": False,
        # Swagger UI and Redoc from drf-spectacular-sidecar's static files, never a CDN.
        "SWAGGER_UI_DIST": "SIDECAR",
        "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
        "REDOC_DIST": "SIDECAR",
        # The waiting endpoints are Channels consumers, not DRF views: added by hand.
        "POSTPROCESSING_HOOKS": [
            "drf_spectacular.hooks.postprocess_schema_enums",
            "runs.api.schema.add_waiting_endpoints",
        ],
        # Enums named after what they list, not after the first field using them.
        "ENUM_NAME_OVERRIDES": {
            "RunStateEnum": "runs.statemachine.RunState",
            "ClosingCauseEnum": "runs.statemachine.ClosingCause",
            "ErrorCodeEnum": "runs.errors.ErrorCode",
            "RiskEnum": ["low", "medium", "high", "deny"],  # a step's or a run's risk, and a rule's outcome
        },
    }
