"""Every API error is the error envelope (docs/data-plane.md#error-envelope):
{"error": {code, message, retryable, source, details}}. No response carries
a stack trace.

DRF's exceptions go through ``exception_handler``; what Django answers by
itself under ``/api/`` (an unrouted path, a body Django refused to read, a
crash outside a view) goes through ``django_error`` (execgo/urls.py's
handlers and catch-all), so no client ever gets an HTML page there.

``retryable`` is true only where the same request can succeed later:
throttling (after ``Retry-After``) and a database that is momentarily
unreachable. Bad input, denials and bugs are never retryable.
"""

import logging

from django.conf import settings
from django.core.exceptions import BadRequest, PermissionDenied, RequestDataTooBig, SuspiciousOperation
from django.db import DataError, InterfaceError, OperationalError
from django.http import Http404, JsonResponse
from django.views import defaults
from django.views.decorators.csrf import csrf_exempt
from rest_framework import exceptions, status
from rest_framework.response import Response

from runs.errors import ErrorCode, ExecGoError, error_envelope

logger = logging.getLogger(__name__)

_CODE_FOR_API_EXCEPTION = {  # the status is the exception's own
    exceptions.NotAuthenticated: ErrorCode.DENIED,
    exceptions.AuthenticationFailed: ErrorCode.DENIED,
    exceptions.PermissionDenied: ErrorCode.DENIED,
    exceptions.NotFound: ErrorCode.NOT_FOUND,
    exceptions.MethodNotAllowed: ErrorCode.INVALID_INPUT,
    exceptions.NotAcceptable: ErrorCode.INVALID_INPUT,
    exceptions.UnsupportedMediaType: ErrorCode.INVALID_INPUT,
    exceptions.Throttled: ErrorCode.EXTERNAL_FAILURE,
    exceptions.ParseError: ErrorCode.INVALID_INPUT,
    exceptions.ValidationError: ErrorCode.INVALID_INPUT,
}


# What a 503 (a store momentarily unreachable) asks a client to wait.
RETRY_AFTER_S = 2


def error_response(envelope: dict, http_status: int) -> Response:
    return Response({"error": envelope}, status=http_status)


def _message(detail) -> str:
    if isinstance(detail, dict):
        if not detail:
            return "invalid input"
        field, value = next(iter(detail.items()))
        return f"{field}: {_message(value)}"
    if isinstance(detail, list):
        return _message(detail[0]) if detail else "invalid input"
    return str(detail)


def _too_large() -> tuple[dict, int]:
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    return error_envelope(ErrorCode.INVALID_INPUT, f"request body exceeds the limit of {limit} bytes",
                          source="api", details={"limit_bytes": limit}), status.HTTP_413_REQUEST_ENTITY_TOO_LARGE


def _envelope_for(exc) -> tuple[dict, int] | None:
    """The envelope and status of an exception that is not DRF's own, or None."""
    if isinstance(exc, ExecGoError):
        return exc.envelope, exc.http_status
    if isinstance(exc, RequestDataTooBig):  # Django refused to read the body
        return _too_large()
    if isinstance(exc, DataError):
        # The database refused a value that validation let through: still
        # the client's input, and the same input fails the same way again.
        logger.warning("database refused a value: %s", exc)
        return error_envelope(ErrorCode.INVALID_INPUT, "a value cannot be stored", source="store",
                              retryable=False), status.HTTP_400_BAD_REQUEST
    if isinstance(exc, (OperationalError, InterfaceError)):
        logger.exception("database unavailable")
        return error_envelope(ErrorCode.EXTERNAL_FAILURE, "the database is unavailable; try again",
                              source="store", retryable=True), status.HTTP_503_SERVICE_UNAVAILABLE
    if isinstance(exc, (BadRequest, SuspiciousOperation)):
        return error_envelope(ErrorCode.INVALID_INPUT, str(exc) or "bad request", source="api"), 400
    return None


def exception_handler(exc, context):
    known = _envelope_for(exc)
    if known is not None:
        response = error_response(*known)
        if known[1] == status.HTTP_503_SERVICE_UNAVAILABLE and known[0].get("retryable"):
            response["Retry-After"] = str(RETRY_AFTER_S)  # a store that is back within seconds, as a rule
        return response
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied()
    if isinstance(exc, exceptions.APIException):
        code = next((code for cls, code in _CODE_FOR_API_EXCEPTION.items() if isinstance(exc, cls)),
                    ErrorCode.UNKNOWN)
        http_status = exc.status_code  # DRF makes a 401 a 403 when no scheme can answer the challenge
        details = {"fields": exc.detail} if isinstance(exc, exceptions.ValidationError) else {}
        response = error_response(
            error_envelope(code, _message(exc.detail), source="api", details=details,
                           retryable=isinstance(exc, exceptions.Throttled)),
            http_status,
        )
        if getattr(exc, "auth_header", None):
            response["WWW-Authenticate"] = exc.auth_header
        if getattr(exc, "wait", None):
            response["Retry-After"] = str(max(int(exc.wait), 1))
        if isinstance(exc, exceptions.MethodNotAllowed) and context.get("view") is not None:
            response["Allow"] = ", ".join(context["view"].allowed_methods)
        return response
    logger.exception("unhandled API error")
    # A bug: the same request would fail the same way.
    return error_response(error_envelope(ErrorCode.INTERNAL, "internal error", source="api", retryable=False), 500)


# --- Django's own answers under /api/ ---------------------------------------

def is_api_path(request) -> bool:
    return request.path_info == "/api" or request.path_info.startswith("/api/")


def _json(envelope: dict, http_status: int) -> JsonResponse:
    return JsonResponse({"error": envelope}, status=http_status)


@csrf_exempt  # a 404 for every method; nothing is written, and a CSRF page would not be the envelope
def api_not_found(request, *args, **kwargs) -> JsonResponse:
    """Any path under /api/ that no route matched, whatever the method."""
    return _json(error_envelope(ErrorCode.NOT_FOUND, f"no API endpoint at {request.path_info!r}", source="api",
                                details={"path": request.path_info}), 404)


def bad_request(request, exception=None):
    if not is_api_path(request):
        return defaults.bad_request(request, exception)
    return _json(*(_envelope_for(exception) or (error_envelope(ErrorCode.INVALID_INPUT, "bad request",
                                                              source="api"), 400)))


def permission_denied(request, exception=None):
    if not is_api_path(request):
        return defaults.permission_denied(request, exception)
    return _json(error_envelope(ErrorCode.DENIED, "permission denied", source="api"), 403)


def page_not_found(request, exception=None):
    if not is_api_path(request):
        return defaults.page_not_found(request, exception)
    return api_not_found(request)


def server_error(request):
    if not is_api_path(request):
        return defaults.server_error(request)
    return _json(error_envelope(ErrorCode.INTERNAL, "internal error", source="api", retryable=False), 500)

