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
view of the file). The helper runs with a built environment, no inherited
descriptors, the step's uid, rlimits of its own and, in the
``linux_sandbox`` profile, inside bubblewrap (the minimal filesystem, own
PID and user namespaces, and the seccomp filter of shell steps when the
plan has it).

Its network (``helper_network``): a network namespace of its own behind
pasta (``sandbox_argv.pasta_argv``: no gateway mapped to the host, no port of
the host's loopback forwarded in, TCP only), for every destination but an
allow-listed internal one. So a response that takes the parser over finds
no database credentials in its process, and no way to the host's loopback
services (PostgreSQL, Redis, the web port) either, whatever address it
tries. Only a destination the operator allow-listed gets the host's
network, as it may be on the host's loopback, which pasta cannot reach.
Without pasta (not installed, or unusable for the sandbox uid), a
``strict`` plan refuses the request (``denied``) and an ``adaptive`` one
sends it from the host's network, saying so in the step's details
(``request_network`` and ``downgrades``).

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
import os
import select
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

from django.conf import settings

from runtime import egress, syscall_filter
from runtime.capabilities import capability_manifest
from runtime.envelopes import EnvelopeError, error_envelope
from runtime.sandbox_argv import bwrap_argv, bwrap_path, pasta_argv, pasta_path

METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
RETRYABLE_STATUS = {408, 429}
REDIRECT_STATUS = {301, 302, 303, 307, 308}
MAX_REDIRECTS = 5
PARAMS = {"method", "url", "headers", "body", "timeout_s", "follow_redirects"}
# Sent to the origin it was meant for only.
CREDENTIAL_HEADERS = {"authorization", "cookie", "proxy-authorization"}
HELPER_PATH = Path(__file__).resolve().parent.parent / "http_helper.py"
HELPER_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
HELPER_ADDRESS_SPACE_BYTES = 1024 * 1024 * 1024
# Time the helper gets past the request's own timeout to start and answer.
HELPER_GRACE_S = 5.0


def max_body_bytes() -> int:
    return settings.EXECGO_HTTP_MAX_BODY_BYTES


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


def helper_network(destination: egress.Destination, plan: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """The network the helper sends a request to ``destination`` from:
    ``("pasta" | "host", the downgrade or None)``; raises ``denied`` when a
    strict plan cannot have pasta (see the module docstring)."""
    if destination.allow_listed and destination.internal_class is not None:
        return "host", None
    reason = _pasta_unusable()
    if reason is None:
        return "pasta", None
    if plan.get("mode") == "strict":
        raise EnvelopeError.of("denied", f"cannot send the request from a network namespace of its own: {reason}",
                               source="executor", details={"what": "request_network", "requested": "pasta",
                                                           "reason": reason})
    return "host", {"what": "request_network", "requested": "pasta", "effective": "host", "reason": reason}


def _pasta_unusable() -> str | None:
    path = pasta_path()
    if not path or not os.access(path, os.X_OK):
        return "pasta (passt) is not installed"
    probe = capability_manifest().get("pasta") or {}
    if not probe.get("available"):
        return f"pasta is unusable on this host: {probe.get('error') or 'not available'}"
    return None


def helper_argv(plan: dict[str, Any], workspace: Path, *, network: str, seccomp_fd: int | None = None
                ) -> list[str]:
    """The helper's command line: ``network`` is ``helper_network``'s word;
    ``seccomp_fd``, the descriptor of the compiled system-call filter the
    helper inherits (``linux_sandbox`` plans that have it)."""
    argv = [settings.EXECGO_HTTP_HELPER_PYTHON, "-I", "-S", "-c", _helper_source()]
    if plan.get("profile") == "linux_sandbox":
        bwrap = bwrap_path()
        if not bwrap:
            raise EnvelopeError.of("denied", "the plan needs bubblewrap, which is not installed on this host")
        # "internet": bubblewrap shares the namespace pasta made in front of it.
        argv = bwrap_argv(bwrap=bwrap, workspace=str(workspace), cwd=str(workspace), env=HELPER_ENV,
                          uid=plan.get("uid"), gid=plan.get("gid"), limits=plan.get("limits") or {},
                          network="host" if network == "host" else "internet", seccomp_fd=seccomp_fd) + argv
    if network == "pasta":
        argv = pasta_argv(pasta_path() or "pasta", tcp_only=True) + argv
    return argv


def extra_ca_certificates() -> str | None:
    """The PEM text of ``EXECGO_HTTP_CA_BUNDLE`` (None when unset)."""
    path = settings.EXECGO_HTTP_CA_BUNDLE
    if not path:
        return None
    try:
        return Path(path).read_text()
    except (OSError, UnicodeError) as exc:
        raise EnvelopeError.of("internal", f"cannot read EXECGO_HTTP_CA_BUNDLE: {exc}", source="executor") from None


_source: list[str] = []


def _helper_source() -> str:
    if not _source:
        _source.append(HELPER_PATH.read_text())
    return _source[0]


def start_helper(plan: dict[str, Any], workspace: Path, *, network: str, stdin: Any, stdout: Any
                 ) -> subprocess.Popen:
    """The helper's process, as the step's uid in a session of its own,
    reading its request from ``stdin``; in a ``linux_sandbox`` plan with the
    filter, under the shell steps' seccomp filter too."""
    uid, gid = plan.get("uid"), plan.get("gid")
    drop = uid is not None and os.geteuid() == 0
    seccomp_fd = None
    if plan.get("profile") == "linux_sandbox" and plan.get("seccomp"):
        try:
            # Opened before the uid drops: the program is the worker's (0600).
            seccomp_fd = os.open(syscall_filter.program_path(), os.O_RDONLY | os.O_CLOEXEC)
        except (syscall_filter.FilterUnavailable, OSError) as exc:
            raise EnvelopeError.of("denied", f"the plan needs the seccomp filter: {exc}", source="executor"
                                   ) from None
    try:
        return subprocess.Popen(
            helper_argv(plan, workspace, network=network, seccomp_fd=seccomp_fd), stdin=stdin, stdout=stdout,
            stderr=subprocess.DEVNULL, env=HELPER_ENV, cwd="/", close_fds=True, start_new_session=True,
            pass_fds=(seccomp_fd,) if seccomp_fd is not None else (),
            **({"user": uid, "group": gid if gid is not None else uid, "extra_groups": []} if drop else {}),
        )  # fmt: skip
    finally:
        if seccomp_fd is not None:
            os.close(seccomp_fd)


def _wait(process: subprocess.Popen, timeout: float) -> bool:
    """Wait for ``process`` to end -> False when it overran. Woken by its
    exit (a pidfd) where it can be: ``Popen.wait(timeout)`` polls, with sleeps
    of up to 50 ms, which a request would pay most of each time."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):
        try:
            process.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        ended = bool(select.select([pidfd], [], [], timeout)[0])
    finally:
        os.close(pidfd)
    if ended:
        process.wait()
    return ended


def call_helper(spec: dict[str, Any], *, plan: dict[str, Any], workspace: Path, directory: Path,
                timeout: float, network: str) -> dict[str, Any]:
    """Run one request in the helper, from ``network`` -> its reply
    (``{"error": "timeout"}`` when it overran). Below the guard: ``spec``'s
    address is taken as checked."""
    request_path, output_path = directory / "http-request.json", directory / "http-reply.json"
    output_cap = 2 * max_body_bytes() + 1024 * 1024  # base64 of the body, the headers, the JSON around them
    spec["limits"] = {"address_space_bytes": HELPER_ADDRESS_SPACE_BYTES, "cpu_seconds": int(timeout) + 2,
                      "output_bytes": output_cap}
    # A file, not a pipe: nothing to write (or block on) once the helper runs.
    # 0600: the request carries the step's headers (its credentials too).
    with open(os.open(request_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as request:
        request.write(json.dumps(spec))
    try:
        with open(request_path, "rb") as request, open(output_path, "wb") as out:
            process = start_helper(plan, workspace, network=network, stdin=request, stdout=out)
    finally:
        request_path.unlink(missing_ok=True)
    if not _wait(process, timeout + HELPER_GRACE_S):
        os.killpg(process.pid, 9)
        process.wait()
        output_path.unlink(missing_ok=True)
        return {"error": "timeout", "message": "the request's process overran"}
    try:
        raw = output_path.read_bytes()
    finally:
        output_path.unlink(missing_ok=True)
    try:
        reply = json.loads(raw)
    except ValueError:
        reply = None
    if not isinstance(reply, dict):
        return {"error": "failed", "message": f"the request's process ended (exit {process.returncode}) "
                                              f"without an answer"}
    return reply


def run(params: dict[str, Any], *, timeout_s: float, plan: dict[str, Any], workspace: Path, directory: Path
        ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    """Make the request -> (output, details, error envelope or None).
    Raises EnvelopeError(denied) when a hop's destination is internal."""
    validate_params(params)
    method = params.get("method", "GET").upper()
    headers = dict(params.get("headers") or {})
    body = params.get("body")
    if isinstance(body, dict | list):
        data: bytes | None = json.dumps(body).encode()
        headers.setdefault("Content-Type", "application/json")
    else:
        data = body.encode() if body is not None else None
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
        network, downgrade = helper_network(destination, plan)
        details["address"] = destination.address
        details["request_network"] = network
        if downgrade is not None and downgrade not in downgrades:
            downgrades.append(downgrade)
            details["downgrades"] = downgrades
        if parts.scheme == "https" and ca_certificates is None:
            ca_certificates = extra_ca_certificates() or ""
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        spec = {"address": destination.address, "port": port, "family": destination.family, "scheme": parts.scheme,
                "host": parts.hostname, "method": method, "target": target, "headers": headers,
                "body_b64": base64.b64encode(data).decode() if data is not None else None,
                "timeout_s": max(remaining, 0.001), "max_body_bytes": max_body_bytes(),
                "ca_certificates": (ca_certificates or None) if parts.scheme == "https" else None}
        reply = call_helper(spec, plan=plan, workspace=workspace, directory=directory,
                            timeout=max(remaining, 0.001), network=network)
        if reply.get("error") == "timeout":
            return {}, details, _timeout_envelope(timeout)
        if reply.get("error") == "certificate":
            # The same server answers the same certificate: no retry.
            return {}, details, error_envelope(
                "external_failure", f"http request failed: the certificate of {parts.hostname} does not verify: "
                                    f"{reply.get('message')}", retryable=False,
                details={"host": parts.hostname, "reason": reply.get("message")})
        if "error" in reply:
            return {}, details, error_envelope("external_failure", f"http request failed: {reply.get('message')}",
                                               retryable=True)
        status = int(reply["status"])
        response_headers = {str(k): str(v) for k, v in reply["headers"]}
        location = next((v for k, v in response_headers.items() if k.lower() == "location"), None)
        if status in REDIRECT_STATUS and location and hop < params.get("follow_redirects", 0):
            following = urljoin(url, location)
            if urlsplit(following).scheme not in ("http", "https"):
                break
            redirects.append({"status_code": status, "location": following})
            if _origin(following) != _origin(url):
                headers = {k: v for k, v in headers.items() if k.lower() not in CREDENTIAL_HEADERS}
            if status == 303 or (status in (301, 302) and method == "POST"):
                method = "GET" if method != "HEAD" else method
                data = None
                headers = {k: v for k, v in headers.items() if k.lower() != "content-type"}
            url = following
            continue
        break
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
