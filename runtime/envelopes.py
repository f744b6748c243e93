"""The two envelopes, the step result and the error
(docs/data-plane.md#envelopes).

Every step result, whatever the tool, is a ``step_result`` dict; every error
anywhere (executor, API, policy) is an ``error_envelope`` dict. Code that
must abort with an error raises ``EnvelopeError``, which carries one.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

ERROR_CODES = frozenset(
    {"unknown", "invalid_input", "timeout", "cancelled", "denied", "not_found", "external_failure", "internal"}
)
ERROR_SOURCES = frozenset({"scheduler", "executor", "policy", "store", "api", "approval"})
STEP_STATUSES = frozenset({"success", "failed", "cancelled"})


def iso_utc(moment: float | datetime) -> str:
    """ISO-8601 in UTC with millisecond precision and a Z suffix."""
    if not isinstance(moment, datetime):
        moment = datetime.fromtimestamp(moment, tz=UTC)
    elif moment.tzinfo is None:
        raise ValueError("naive datetime: the envelope needs an aware UTC timestamp")
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def error_envelope(
    code: str,
    message: str,
    *,
    retryable: bool = False,
    source: str = "executor",
    details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    if code not in ERROR_CODES:
        raise ValueError(f"unknown error code {code!r}")
    if source not in ERROR_SOURCES:
        raise ValueError(f"unknown error source {source!r}")
    return {"code": code, "message": message, "retryable": retryable, "source": source, "details": details or {}}


class EnvelopeError(Exception):
    """An error that already knows its envelope (raised before or instead of a run)."""

    def __init__(self, envelope: dict[str, Any]):
        super().__init__(envelope["message"])
        self.envelope = envelope

    @classmethod
    def of(cls, code: str, message: str, **kwargs: Any) -> EnvelopeError:
        return cls(error_envelope(code, message, **kwargs))

    @property
    def code(self) -> str:
        return self.envelope["code"]


def step_result(
    *,
    status: str,
    handle_id: str,
    output: dict[str, Any] | None,
    started_at: float | datetime,
    finished_at: float | datetime,
    attempt: int,
    details: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    if status not in STEP_STATUSES:
        raise ValueError(f"unknown step status {status!r}")
    if (status == "success") != (error is None):
        raise ValueError("a successful step has no error and a failed or cancelled one has one")
    start = started_at.timestamp() if isinstance(started_at, datetime) else started_at
    finish = finished_at.timestamp() if isinstance(finished_at, datetime) else finished_at
    return {
        "status": status,
        "handle_id": handle_id,
        "output": output if output is not None else {},
        "started_at": iso_utc(started_at),
        "finished_at": iso_utc(finished_at),
        "duration_ms": max(0, int(round((finish - start) * 1000))),
        "attempt": attempt,
        "details": details or {},
        "error": error,
    }


def failed_result(
    handle_id: str,
    error: dict[str, Any],
    *,
    attempt: int,
    started_at: float,
    finished_at: float | None = None,
    details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A step that ended in an error without producing output."""
    status = "cancelled" if error["code"] == "cancelled" else "failed"
    return step_result(
        status=status,
        handle_id=handle_id,
        output={},
        started_at=started_at,
        finished_at=finished_at if finished_at is not None else started_at,
        attempt=attempt,
        details=details,
        error=error,
    )
