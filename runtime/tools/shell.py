"""The ``shell`` tool: params, the shim request, and the result envelope.

Params: ``{"argv": ["prog", "arg", …]}`` or ``{"script": "…"}`` (run by
``/bin/sh -c``), plus optional ``cwd`` (relative, inside the workspace),
``env`` (names filtered by an allow-list; the rest are dropped and listed in
``details.env_dropped``) and ``stdin`` (text fed to the command).

The command never inherits the worker's environment (which holds database
and broker credentials): it gets PATH, HOME (the workspace), LANG, TMPDIR,
the allowed names from ``env`` and ``EXECGO_HANDLE_ID`` (the marker used to
find its processes).
"""

from __future__ import annotations

import errno
import fnmatch
import os
import re
from pathlib import Path
from typing import Any

from django.conf import settings

from runtime import shim, syscall_filter
from runtime.envelopes import EnvelopeError, error_envelope, step_result
from runtime.sandbox import identity_files, mount_plan
from runtime.sandbox_argv import bwrap_argv, bwrap_path, pasta_argv, pasta_path
from runtime.tools.file import relative_parts

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
LIMIT_TERMINATIONS = {
    "cpu_limit": "the command exceeded its CPU time limit",
    "memory_limit": "the command ran out of its address-space limit",
    "file_size_limit": "the command exceeded its file size limit",
    "workspace_limit": "the command filled its workspace quota",
}


def _invalid(message: str, **details: Any) -> EnvelopeError:
    return EnvelopeError.of("invalid_input", message, source="executor", details=details)


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and "\x00" not in value


def validate_params(params: Any) -> None:
    if not isinstance(params, dict):
        raise _invalid("shell params must be an object")
    unknown = sorted(set(params) - {"argv", "script", "cwd", "env", "stdin"})
    if unknown:
        raise _invalid(f"unknown shell params: {', '.join(unknown)}", unknown=unknown)
    if ("argv" in params) == ("script" in params):
        raise _invalid("give exactly one of argv or script")
    if "argv" in params:
        argv = params["argv"]
        if not isinstance(argv, list) or not argv or not all(_is_text(a) for a in argv) or not argv[0]:
            raise _invalid("argv must be a non-empty list of strings without NUL bytes")
    elif not _is_text(params["script"]) or not params["script"].strip():
        raise _invalid("script must be a non-empty string without NUL bytes")
    if "cwd" in params:
        if not _is_text(params["cwd"]):
            raise _invalid("cwd must be a string")
        relative_parts(params["cwd"])
    env = params.get("env", {})
    if not isinstance(env, dict):
        raise _invalid("env must be an object of strings")
    for name, value in env.items():
        if not ENV_NAME.match(name) or not _is_text(value):
            raise _invalid(f"bad environment variable {name!r}", name=name)
    if "stdin" in params and not isinstance(params["stdin"], str):
        raise _invalid("stdin must be a string")


def _allowed(name: str) -> bool:
    patterns = settings.EXECGO_SHELL_ENV_ALLOWLIST
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def build_request(params: dict[str, Any], *, handle_id: str, workspace: Path, plan: dict[str, Any]) -> dict[str, Any]:
    """The shell-specific part of request.json (argv, cwd, env, sandbox)."""
    argv = (
        params["argv"] if "argv" in params else [settings.EXECGO_SHELL, "-c", params["script"]]
    )
    cwd = workspace.joinpath(*relative_parts(params.get("cwd", ".")))
    env, dropped = _command_env(params.get("env") or {}, handle_id=handle_id, workspace=workspace)
    sandbox: list[str] = []
    isolation = None
    own_proc = False
    seccomp = None  # the compiled filter's file, which the shim hands bubblewrap
    limits = plan.get("limits") or {}
    contained = plan.get("profile") == "linux_sandbox" or plan.get("namespaces")
    identity = identity_files(str(workspace.parent), uid=plan.get("uid"), gid=plan.get("gid"),
                              home=str(workspace)) if contained else {}
    if plan.get("profile") == "linux_sandbox":
        sandbox, own_proc, seccomp = _bubblewrap(plan, workspace=workspace, cwd=cwd, env=env, identity=identity)
    elif plan.get("namespaces"):
        # The shim makes these mounts itself, in the command's own mount namespace.
        isolation = {
            "mounts": mount_plan(workspace=str(workspace), cwd=str(cwd), limits=limits, writable_root=True,
                                 readonly_paths=plan.get("readonly_paths") or (), identity=identity,
                                 uid=plan.get("uid")),
            "network": plan.get("network") or "none",
        }
    return {
        "argv": argv,
        "cwd": str(cwd),
        "env": env,
        "env_dropped": sorted(dropped),
        "sandbox_argv": sandbox,
        "isolation": isolation,
        "own_proc": own_proc,
        "seccomp": seccomp,
        "stdin": "stdin" in params,
    }


def _command_env(requested: dict[str, str], *, handle_id: str, workspace: Path) -> tuple[dict[str, str], list[str]]:
    """The command's whole environment (see the module docstring), and the
    names of ``requested`` the allow-list dropped."""
    env = {
        "PATH": settings.EXECGO_SHELL_PATH,
        "HOME": str(workspace),
        "LANG": "C.UTF-8",
        "TMPDIR": "/tmp",
    }
    dropped = []
    for name, value in requested.items():
        if _allowed(name):
            env[name] = value
        else:
            dropped.append(name)
    env[shim.MARKER_ENV] = handle_id
    return env, dropped


def _bubblewrap(plan: dict[str, Any], *, workspace: Path, cwd: Path, env: dict[str, str],
                identity: dict[str, str]) -> tuple[list[str], bool, str | None]:
    """What runs the command in a ``linux_sandbox`` plan: bubblewrap's
    command line (behind pasta's for ``"network": "internet"``), whether the
    shim must give it a /proc of its own (pasta finds bubblewrap's
    namespaces there), and the seccomp filter's file -> denied when the host
    lacks one of them."""
    bwrap = bwrap_path()
    if not bwrap:
        raise EnvelopeError.of("denied", "the plan needs bubblewrap, which is not installed on this host")
    network = plan.get("network") or "none"
    seccomp = None
    if plan.get("seccomp"):
        try:
            seccomp = syscall_filter.program_path()
        except syscall_filter.FilterUnavailable as exc:
            raise EnvelopeError.of("denied", f"the plan needs the seccomp filter: {exc}") from None
    sandbox = bwrap_argv(
        bwrap=bwrap, workspace=str(workspace), cwd=str(cwd), env=env, uid=plan.get("uid"), gid=plan.get("gid"),
        limits=plan.get("limits") or {}, network=network, readonly_paths=plan.get("readonly_paths") or (),
        identity=identity, seccomp_fd=syscall_filter.SECCOMP_FD if seccomp else None,
    )
    if network != "internet":
        return sandbox, False, seccomp
    pasta = pasta_path()
    if not pasta:
        raise EnvelopeError.of("denied", "the plan needs pasta (passt), which is not installed on this host")
    return pasta_argv(pasta) + sandbox, True, seccomp


def _tail_text(path: Path, limit: int) -> str:
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, size - limit))
            data = fh.read(limit)
    except FileNotFoundError:
        return ""
    if len(data) < size:
        # Cut mid-file: skip UTF-8 continuation bytes rather than show U+FFFD.
        skip = 0
        while skip < min(3, len(data)) and 0x80 <= data[skip] <= 0xBF:
            skip += 1
        data = data[skip:]
    return data.decode(errors="replace")


def _error_for(outcome: dict[str, Any], request: dict[str, Any]) -> dict[str, Any] | None:
    termination = outcome.get("termination")
    evidence = {"termination": termination, "evidence": outcome.get("evidence")}
    if outcome.get("shim_error") or termination is None:
        return error_envelope(
            "internal",
            f"the shim failed: {outcome.get('shim_error')}",
            details={"shim_error": outcome.get("shim_error")},
        )
    if termination == "exited" and outcome.get("exit_code") == 0:
        return None
    if termination == "cancelled":
        return error_envelope("cancelled", "the step was cancelled", details=evidence)
    if termination == "timeout":
        timeout_ms = int(float(request.get("timeout_s") or 0) * 1000)
        return error_envelope(
            "timeout", f"step exceeded timeout {timeout_ms}ms", retryable=True, details={"timeout_ms": timeout_ms}
        )
    if termination in LIMIT_TERMINATIONS:
        limits = request.get("limits") or {}
        return error_envelope(
            "external_failure", LIMIT_TERMINATIONS[termination], details={**evidence, "limits": limits}
        )
    if termination == "exec_failed":
        failure = outcome.get("exec_error") or {}
        code = {errno.ENOENT: "not_found", errno.EACCES: "denied", errno.EPERM: "denied"}.get(
            failure.get("errno"), "external_failure"
        )
        return error_envelope(code, f"cannot start the command: {failure.get('message')}", details=evidence)
    if termination == "signaled":
        return error_envelope(
            "external_failure", f"the command was killed by {outcome.get('signal_name')}", details=evidence
        )
    # A command that exits non-zero may succeed on another try (a flaky
    # network, a lock); the step's own ``retries`` decides whether it gets one.
    return error_envelope(
        "external_failure",
        f"the command exited with code {outcome.get('exit_code')}",
        retryable=True,
        details={**evidence, "exit_code": outcome.get("exit_code")},
    )


def result_envelope(outcome: dict[str, Any], request: dict[str, Any], task_dir: Path) -> dict[str, Any]:
    """Turn the shim's facts (result.json) into the step result (docs/data-plane.md#step-result)."""
    tail = settings.EXECGO_OUTPUT_TAIL_BYTES
    error = _error_for(outcome, request)
    status = "success" if error is None else ("cancelled" if error["code"] == "cancelled" else "failed")
    exit_code = outcome.get("exit_code")
    started = outcome.get("started_at") or request.get("prepared_at")
    details = {
        "exit_code": exit_code,
        "signal": outcome.get("signal"),
        "signal_name": outcome.get("signal_name"),
        "stderr": _tail_text(task_dir / shim.STDERR_FILE, tail),
        "stdout_truncated_bytes": outcome.get("stdout_truncated_bytes", 0),
        "stderr_truncated_bytes": outcome.get("stderr_truncated_bytes", 0),
        "stdout_bytes": outcome.get("stdout_bytes", 0),
        "stderr_bytes": outcome.get("stderr_bytes", 0),
        "rusage": outcome.get("rusage") or {},
        "termination": outcome.get("termination"),
        "evidence": outcome.get("evidence"),
        "exec_error": outcome.get("exec_error"),
        "tree_kill": outcome.get("tree_kill"),
        "started_by": outcome.get("started_by"),
        "notes": outcome.get("notes") or [],
        "env_dropped": request.get("env_dropped") or [],
        "plan": request.get("plan") or {},
    }
    return step_result(
        status=status,
        handle_id=request["handle_id"],
        output={"exit_code": exit_code, "stdout": _tail_text(task_dir / shim.STDOUT_FILE, tail)},
        started_at=started,
        finished_at=outcome.get("finished_at") or started,
        attempt=request.get("attempt", 1),
        details=details,
        error=error,
    )
