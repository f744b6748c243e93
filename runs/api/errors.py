"""Every API error is the SPEC §4 envelope: {"error": {code, message,
retryable, source, details}}. No response carries a stack trace."""

import logging

from django.conf import settings
from django.core.exceptions import PermissionDenied, RequestDataTooBig
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response

from runs.errors import ErrorCode, ExecGoError, error_envelope

logger = logging.getLogger(__name__)

_CODE_FOR_API_EXCEPTION = {
    exceptions.NotAuthenticated: (ErrorCode.DENIED, status.HTTP_401_UNAUTHORIZED),
    exceptions.AuthenticationFailed: (ErrorCode.DENIED, status.HTTP_401_UNAUTHORIZED),
    exceptions.PermissionDenied: (ErrorCode.DENIED, status.HTTP_403_FORBIDDEN),
    exceptions.NotFound: (ErrorCode.NOT_FOUND, status.HTTP_404_NOT_FOUND),
    exceptions.MethodNotAllowed: (ErrorCode.INVALID_INPUT, status.HTTP_405_METHOD_NOT_ALLOWED),
    exceptions.NotAcceptable: (ErrorCode.INVALID_INPUT, status.HTTP_406_NOT_ACCEPTABLE),
    exceptions.UnsupportedMediaType: (ErrorCode.INVALID_INPUT, status.HTTP_415_UNSUPPORTED_MEDIA_TYPE),
    exceptions.Throttled: (ErrorCode.EXTERNAL_FAILURE, status.HTTP_429_TOO_MANY_REQUESTS),
    exceptions.ParseError: (ErrorCode.INVALID_INPUT, status.HTTP_400_BAD_REQUEST),
    exceptions.ValidationError: (ErrorCode.INVALID_INPUT, status.HTTP_400_BAD_REQUEST),
}


def error_response(envelope: dict, http_status: int) -> Response:
    return Response({"error": envelope}, status=http_status)


def _message(detail) -> str:
    if isinstance(detail, dict):
        field, value = next(iter(detail.items()))
        return f"{field}: {_message(value)}"
    if isinstance(detail, list):
        return _message(detail[0]) if detail else "invalid input"
    return str(detail)


def exception_handler(exc, context):
    if isinstance(exc, ExecGoError):
        return error_response(exc.envelope, exc.http_status)
    if isinstance(exc, RequestDataTooBig):
        # Django refuses to read a body over DATA_UPLOAD_MAX_MEMORY_SIZE.
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        return error_response(
            error_envelope(ErrorCode.INVALID_INPUT, f"request body exceeds the limit of {limit} bytes",
                           source="api", details={"limit_bytes": limit}),
            400,
        )
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied()
    if isinstance(exc, exceptions.APIException):
        code, http_status = next(
            (value for cls, value in _CODE_FOR_API_EXCEPTION.items() if isinstance(exc, cls)),
            (ErrorCode.UNKNOWN, exc.status_code),
        )
        details = {"fields": exc.detail} if isinstance(exc, exceptions.ValidationError) else {}
        response = error_response(
            error_envelope(code, _message(exc.detail), source="api", details=details,
                           retryable=isinstance(exc, exceptions.Throttled)),
            http_status,
        )
        if getattr(exc, "wait", None):
            response["Retry-After"] = str(int(exc.wait))
        return response
    logger.exception("unhandled API error")
    return error_response(error_envelope(ErrorCode.INTERNAL, "internal error", source="api"), 500)
