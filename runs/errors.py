"""The one error envelope (docs/data-plane.md#error-envelope), used by step
results, traces and the API."""

from typing import Any

from django.db import models

from runtime.envelopes import error_envelope as runtime_error_envelope


class ErrorCode(models.TextChoices):
    UNKNOWN = "unknown"
    INVALID_INPUT = "invalid_input"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    DENIED = "denied"
    NOT_FOUND = "not_found"
    EXTERNAL_FAILURE = "external_failure"
    INTERNAL = "internal"


# A command that exits non-zero (external_failure) may well succeed on a
# second try, so it is retryable; a step is retried only when the agent asked
# for retries. Bad input and denials never are.
# Conflict is not an error code of its own: a refused second decision or a
# cancel of a final run is ``invalid_input`` in a 409 response.
DEFAULT_RETRYABLE = {
    ErrorCode.TIMEOUT: True,
    ErrorCode.EXTERNAL_FAILURE: True,
    ErrorCode.INTERNAL: True,
}


def error_envelope(code: str, message: str, *, source: str, retryable: bool | None = None,
                   details: dict[str, Any] | None = None) -> dict[str, Any]:
    return runtime_error_envelope(
        str(code), message, source=source, details=details,
        retryable=DEFAULT_RETRYABLE.get(code, False) if retryable is None else retryable,
    )


class ExecGoError(Exception):
    """A failure that carries its envelope."""

    http_status = 400

    def __init__(self, code: str, message: str, *, source: str, retryable: bool | None = None,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.envelope = error_envelope(code, message, source=source, retryable=retryable, details=details)


class DeniedError(ExecGoError):
    """The caller may not do this (403)."""

    http_status = 403


class ConflictError(ExecGoError):
    """The request is well-formed but the resource's state refuses it (409)."""

    http_status = 409
