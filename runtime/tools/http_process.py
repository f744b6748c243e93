"""The worker's side of the helper process an http step's request runs in
(runtime/http_helper.py): the network it sends from, its command line, its
start as the step's uid, and its reply.

The helper runs with a built environment, no inherited descriptors, the
step's uid, rlimits of its own and, in the ``linux_sandbox`` profile,
inside bubblewrap (the minimal filesystem, own PID and user namespaces, and
the seccomp filter of shell steps when the plan has it). It reads its
request from a file and writes its reply to another, both in the step's
task directory.

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
"""

from __future__ import annotations

import json
import os
import select
import subprocess
from pathlib import Path
from typing import Any

from django.conf import settings

from runtime import egress, syscall_filter
from runtime.capabilities import capability_manifest
from runtime.envelopes import EnvelopeError
from runtime.sandbox_argv import bwrap_argv, bwrap_path, pasta_argv, pasta_path

HELPER_PATH = Path(__file__).resolve().parent.parent / "http_helper.py"
HELPER_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
HELPER_ADDRESS_SPACE_BYTES = 1024 * 1024 * 1024
# Time the helper gets past the request's own timeout to start and answer.
HELPER_GRACE_S = 5.0


def max_body_bytes() -> int:
    return settings.EXECGO_HTTP_MAX_BODY_BYTES


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
    ended = False
    try:
        ended = _wait(process, timeout + HELPER_GRACE_S)
    finally:  # overran, or the step is being cancelled (runtime/tool_process.py): the request goes with it
        if not ended:
            os.killpg(process.pid, 9)
            process.wait()
            output_path.unlink(missing_ok=True)
    if not ended:
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
