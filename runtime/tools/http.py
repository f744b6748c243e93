"""The ``http`` tool: one request with urllib, in the worker process.

Params: ``{"method", "url", "headers", "body", "timeout_s"}``. Only http and
https URLs. The response body is read up to ``EXECGO_HTTP_MAX_BODY_BYTES``
(the rest is not downloaded). A 2xx/3xx response is a success; 4xx/5xx is
``external_failure`` with the response still in ``output`` (retryable for
408, 429 and 5xx); connection failures are retryable ``external_failure``,
a timeout is ``timeout``.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings

from runtime.envelopes import EnvelopeError, error_envelope

METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
RETRYABLE_STATUS = {408, 429}


def max_body_bytes() -> int:
    return settings.EXECGO_HTTP_MAX_BODY_BYTES


def _invalid(message: str, **details: Any) -> EnvelopeError:
    return EnvelopeError.of("invalid_input", message, source="executor", details=details)


def validate_params(params: Any) -> None:
    if not isinstance(params, dict):
        raise _invalid("http params must be an object")
    unknown = sorted(set(params) - {"method", "url", "headers", "body", "timeout_s"})
    if unknown:
        raise _invalid(f"unknown http params: {', '.join(unknown)}", unknown=unknown)
    method = params.get("method", "GET")
    if not isinstance(method, str) or method.upper() not in METHODS:
        raise _invalid(f"method must be one of {', '.join(METHODS)}", method=method)
    url = params.get("url")
    if not isinstance(url, str):
        raise _invalid("url must be a string")
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise _invalid(f"url is malformed: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _invalid("url must be an absolute http:// or https:// URL", url=url)
    headers = params.get("headers", {})
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and not any(c in k + v for c in "\r\n\x00")
        for k, v in headers.items()
    ):
        raise _invalid("headers must be an object of single-line strings")
    body = params.get("body")
    if body is not None and not isinstance(body, str | dict | list):
        raise _invalid("body must be a string, or an object/list sent as JSON")
    timeout = params.get("timeout_s")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0):
        raise _invalid("timeout_s must be a positive number")


def _decode(data: bytes, content_type: str | None) -> str:
    charset = "utf-8"
    for piece in (content_type or "").split(";")[1:]:
        key, _, value = piece.strip().partition("=")
        if key.lower() == "charset" and value:
            charset = value.strip('"')
    try:
        return data.decode(charset, errors="replace")
    except LookupError:
        return data.decode("utf-8", errors="replace")


def run(params: dict[str, Any], *, timeout_s: float) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    """Make the request -> (output, details, error envelope or None)."""
    validate_params(params)
    method = params.get("method", "GET").upper()
    headers = dict(params.get("headers") or {})
    body = params.get("body")
    if isinstance(body, dict | list):
        data: bytes | None = json.dumps(body).encode()
        headers.setdefault("Content-Type", "application/json")
    else:
        data = body.encode() if body is not None else None
    timeout = min(float(params.get("timeout_s") or timeout_s), timeout_s)
    request = urllib.request.Request(params["url"], data=data, headers=headers, method=method)
    details: dict[str, Any] = {"method": method, "url": params["url"]}
    try:
        try:
            response = urllib.request.urlopen(request, timeout=timeout)
        except urllib.error.HTTPError as exc:
            response = exc  # a 4xx/5xx still has a status, headers and a body
        with response:
            status = response.status if hasattr(response, "status") else response.code
            raw = response.read(max_body_bytes() + 1)
            content_type = response.headers.get("Content-Type")
            response_headers = {k: v for k, v in response.headers.items()}
    except TimeoutError:
        return {}, details, error_envelope(
            "timeout", f"http request exceeded timeout {int(timeout * 1000)}ms", retryable=True,
            details={"timeout_ms": int(timeout * 1000)},
        )  # fmt: skip
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, TimeoutError | socket.timeout):
            return {}, details, error_envelope(
                "timeout", f"http request exceeded timeout {int(timeout * 1000)}ms", retryable=True,
                details={"timeout_ms": int(timeout * 1000)},
            )  # fmt: skip
        return {}, details, error_envelope("external_failure", f"http request failed: {reason}", retryable=True)
    except (OSError, http.client.HTTPException) as exc:
        return {}, details, error_envelope("external_failure", f"http request failed: {exc!r}", retryable=True)
    truncated = len(raw) > max_body_bytes()
    raw = raw[: max_body_bytes()]
    output = {"status_code": status, "body": _decode(raw, content_type)}
    details.update(
        {"status_code": status, "headers": response_headers, "body_bytes": len(raw), "body_truncated": truncated}
    )
    error = None
    if status >= 400:
        error = error_envelope(
            "external_failure",
            f"http {method} returned {status}",
            retryable=status in RETRYABLE_STATUS or status >= 500,
            details={"status_code": status},
        )
    return output, details, error
