"""The ``http`` tool: one request per hop, behind the egress guard, in a
helper process of its own.

Params: ``{"method", "url", "headers", "body", "timeout_s",
"follow_redirects"}``. Only http and https URLs. The worker resolves the
host once and checks the address (runtime/egress.py: loopback, private,
link-local, metadata and the other internal classes are ``denied`` unless
``EXECGO_HTTP_ALLOWED_NETWORKS`` lists them), then starts the helper
(runtime/http_helper.py) that connects to that address only, keeping the
Host header and, for https, the server name and certificate check of the
URL's host (the system's CAs, plus ``EXECGO_HTTP_CA_BUNDLE``'s when set:
the worker reads it and hands the helper its text, so the helper needs no
view of the file). How the helper is contained, and the network it sends
from, is runtime/tools/http_process.py's.

Redirects are not followed unless ``follow_redirects`` (0 to
``MAX_REDIRECTS``) says how many; each hop goes through the guard again,
and headers that carry credentials are dropped when a hop changes origin.
The response body is read up to ``EXECGO_HTTP_MAX_BODY_BYTES`` (the rest is
not downloaded). A 2xx/3xx response is a success; 4xx/5xx is
``external_failure`` with the response still in ``output`` (retryable for
408, 429 and 5xx); connection failures are retryable ``external_failure``,
a certificate that does not verify is a ``external_failure`` that is not,
a timeout is ``timeout``.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, urljoin, urlsplit

from runtime import egress
from runtime.envelopes import EnvelopeError, error_envelope
from runtime.tools import http_process

METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
RETRYABLE_STATUS = {408, 429}
REDIRECT_STATUS = {301, 302, 303, 307, 308}
MAX_REDIRECTS = 5
PARAMS = {"method", "url", "headers", "body", "timeout_s", "follow_redirects"}
# Sent to the origin it was meant for only.
CREDENTIAL_HEADERS = {"authorization", "cookie", "proxy-authorization"}


def _invalid(message: str, **details: Any) -> EnvelopeError:
    return EnvelopeError.of("invalid_input", message, source="executor", details=details)


def validate_params(params: Any) -> None:
    if not isinstance(params, dict):
        raise _invalid("http params must be an object")
    unknown = sorted(set(params) - PARAMS)
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
    follow = params.get("follow_redirects", 0)
    if isinstance(follow, bool) or not isinstance(follow, int) or not 0 <= follow <= MAX_REDIRECTS:
        raise _invalid(f"follow_redirects must be a whole number from 0 to {MAX_REDIRECTS}",
                       follow_redirects=follow)


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


def _timeout_envelope(timeout: float) -> dict[str, Any]:
    return error_envelope("timeout", f"http request exceeded timeout {int(timeout * 1000)}ms", retryable=True,
                          details={"timeout_ms": int(timeout * 1000)})


def _origin(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or (443 if parts.scheme == "https" else 80)


def run(params: dict[str, Any], *, timeout_s: float, plan: dict[str, Any], workspace: Path, directory: Path
        ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    """Make the request -> (output, details, error envelope or None).
    Raises EnvelopeError(denied) when a hop's destination is internal."""
    validate_params(params)
    method = params.get("method", "GET").upper()
    headers = dict(params.get("headers") or {})
    data = _body_bytes(params.get("body"), headers)
    headers.setdefault("User-Agent", "ExecGo-http")
    headers.setdefault("Connection", "close")
    timeout = min(float(params.get("timeout_s") or timeout_s), timeout_s)
    deadline = time.monotonic() + timeout
    url = params["url"]
    details: dict[str, Any] = {"method": method, "url": url}
    redirects: list[dict[str, Any]] = []
    downgrades: list[dict[str, Any]] = []
    ca_certificates: str | None = None  # read at the first https hop
    for hop in range(params.get("follow_redirects", 0) + 1):
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return {}, details, _timeout_envelope(timeout)
        extra = {"url": url, "hop": hop} if hop else {}
        destination = egress.check_destination(parts.hostname or "", port, timeout_s=remaining, **extra)
        network, downgrade = http_process.helper_network(destination, plan)
        details["address"] = destination.address
        details["request_network"] = network
        if downgrade is not None and downgrade not in downgrades:
            downgrades.append(downgrade)
            details["downgrades"] = downgrades
        if parts.scheme == "https" and ca_certificates is None:
            ca_certificates = http_process.extra_ca_certificates() or ""
        spec = _hop_spec(destination, parts, port, method=method, headers=headers, data=data, remaining=remaining,
                         ca_certificates=ca_certificates)
        reply = http_process.call_helper(spec, plan=plan, workspace=workspace, directory=directory,
                            timeout=max(remaining, 0.001), network=network)
        error = _hop_error(reply, parts.hostname, timeout)
        if error is not None:
            return {}, details, error
        status = int(reply["status"])
        response_headers = {str(k): str(v) for k, v in reply["headers"]}
        location = next((v for k, v in response_headers.items() if k.lower() == "location"), None)
        if status in REDIRECT_STATUS and location and hop < params.get("follow_redirects", 0):
            following = urljoin(url, location)
            if urlsplit(following).scheme not in ("http", "https"):
                break
            redirects.append({"status_code": status, "location": following})
            method, headers, data = _redirected(status, method, headers, data,
                                                same_origin=_origin(following) == _origin(url))
            url = following
            continue
        break
    return _response(reply, status, response_headers, method=method, url=url, details=details, redirects=redirects)


def _body_bytes(body: Any, headers: dict[str, str]) -> bytes | None:
    """The request body as sent: an object or list as JSON (its
    Content-Type set in ``headers`` unless given), text as UTF-8."""
    if isinstance(body, dict | list):
        headers.setdefault("Content-Type", "application/json")
        return json.dumps(body).encode()
    return body.encode() if body is not None else None


def _hop_spec(destination: egress.Destination, parts: SplitResult, port: int, *, method: str,
              headers: dict[str, str], data: bytes | None, remaining: float, ca_certificates: str | None
              ) -> dict[str, Any]:
    """What the helper is told to send for one hop: to the checked address,
    with the URL's host for the Host header and the certificate check."""
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return {"address": destination.address, "port": port, "family": destination.family, "scheme": parts.scheme,
            "host": parts.hostname, "method": method, "target": target, "headers": headers,
            "body_b64": base64.b64encode(data).decode() if data is not None else None,
            "timeout_s": max(remaining, 0.001), "max_body_bytes": http_process.max_body_bytes(),
            "ca_certificates": (ca_certificates or None) if parts.scheme == "https" else None}


def _hop_error(reply: dict[str, Any], host: str | None, timeout: float) -> dict[str, Any] | None:
    """The error envelope of a hop whose request got no response, else None."""
    if reply.get("error") == "timeout":
        return _timeout_envelope(timeout)
    if reply.get("error") == "certificate":
        # The same server answers the same certificate: no retry.
        return error_envelope(
            "external_failure", f"http request failed: the certificate of {host} does not verify: "
                                f"{reply.get('message')}", retryable=False,
            details={"host": host, "reason": reply.get("message")})
    if "error" in reply:
        return error_envelope("external_failure", f"http request failed: {reply.get('message')}", retryable=True)
    return None


def _redirected(status: int, method: str, headers: dict[str, str], data: bytes | None, *, same_origin: bool
                ) -> tuple[str, dict[str, str], bytes | None]:
    """The method, headers and body of the request that follows a redirect:
    no credentials to another origin; a 303 (or a POST's 301 or 302) turns
    into a GET without a body."""
    if not same_origin:
        headers = {k: v for k, v in headers.items() if k.lower() not in CREDENTIAL_HEADERS}
    if status == 303 or (status in (301, 302) and method == "POST"):
        method = "GET" if method != "HEAD" else method
        data = None
        headers = {k: v for k, v in headers.items() if k.lower() != "content-type"}
    return method, headers, data


def _response(reply: dict[str, Any], status: int, response_headers: dict[str, str], *, method: str, url: str,
              details: dict[str, Any], redirects: list[dict[str, Any]]
              ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    """The last hop's response as the step's (output, details, error or None)."""
    raw = base64.b64decode(reply["body_b64"])
    content_type = next((v for k, v in response_headers.items() if k.lower() == "content-type"), None)
    output = {"status_code": status, "body": _decode(raw, content_type)}
    details.update({"status_code": status, "headers": response_headers, "body_bytes": len(raw),
                    "body_truncated": bool(reply.get("truncated"))})
    if redirects:
        details["redirects"] = redirects
        details["final_url"] = url
    error = None
    if status >= 400:
        error = error_envelope(
            "external_failure",
            f"http {method} returned {status}",
            retryable=status in RETRYABLE_STATUS or status >= 500,
            details={"status_code": status},
        )
    return output, details, error
