"""The one error of the client: the server's error envelope, or one the
client makes in the same shape when no answer came, so a caller handles a
refused plan, a lost connection and a timeout alike."""

from __future__ import annotations

from typing import Any

import httpx


class ExecGoError(Exception):
    """A failed call: the server's ``{"error": {code, message, retryable,
    source, details}}`` envelope, plus the HTTP status (None when no response
    came: the client made the envelope itself, with ``source="client"``)."""

    def __init__(self, code: str, message: str, *, retryable: bool = False, source: str = "client",
                 details: dict[str, Any] | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable
        self.source = source
        self.details = details or {}
        self.status = status

    @property
    def envelope(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "retryable": self.retryable,
                          "source": self.source, "details": self.details}}

    def __str__(self) -> str:
        status = f" (HTTP {self.status})" if self.status is not None else ""
        return f"{self.code}: {self.message}{status}"

    def __repr__(self) -> str:
        return f"ExecGoError({self.code!r}, {self.message!r}, status={self.status!r})"

    @classmethod
    def from_response(cls, response: httpx.Response) -> ExecGoError:
        try:
            body = response.json()
        except ValueError:
            body = None
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict) and "code" in error:
            return cls(str(error["code"]), str(error.get("message", "")), retryable=bool(error.get("retryable")),
                       source=str(error.get("source", "api")), details=error.get("details") or {},
                       status=response.status_code)
        # Not an envelope: a URL the server does not route, a proxy's page, ...
        status = response.status_code
        code = {401: "denied", 403: "denied", 404: "not_found", 408: "timeout", 504: "timeout"}.get(
            status, "internal" if status >= 500 else "external_failure" if status == 429 else "invalid_input")
        return cls(code, f"HTTP {status} {response.reason_phrase} from {response.request.method} {response.request.url}",
                   retryable=status >= 500 or status == 429, source="client",
                   details={"body": response.text[:500]}, status=status)


def transport_error(exc: httpx.TransportError, method: str, url: str) -> ExecGoError:
    """No answer came (a refused or dropped connection, a timeout): retryable,
    since the server never said no."""
    code = "timeout" if isinstance(exc, httpx.TimeoutException) else "external_failure"
    return ExecGoError(code, f"{method} {url}: {type(exc).__name__}: {exc}", retryable=True, source="client",
                       details={"exception": type(exc).__name__})
