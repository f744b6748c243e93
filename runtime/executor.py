"""Run one tool call to its end: a shell step in its shim (launched, then
waited for), an ``http`` step in a process forked for it
(runtime/tool_process.py: it checks each destination, and the request runs
in a helper process of its own, see runtime/tools/http.py), waited for as a
shim is, and a ``file`` step here in the worker: its work is bounded local
I/O (runtime/tools/file.py), with nothing to wait on that would free the
process meanwhile."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from runtime import forkserver, shim, tool_process
from runtime.attach import wait
from runtime.envelopes import EnvelopeError, error_envelope, failed_result, step_result
from runtime.launcher import launch, prepare_request
from runtime.layout import WORKSPACE_DIR, write_json_atomic
from runtime.tools import file as file_tool
from runtime.tools import http as http_tool

logger = logging.getLogger(__name__)


def execute(
    handle_id: str,
    *,
    tool: str,
    params: dict,
    timeout_s: float,
    attempt: int,
    plan: dict,
    cancel_requested: Callable[[], bool] | None = None,
    on_progress: Callable[[int, str], None] | None = None,
    spare: forkserver.ShimLink | None = None,
    while_running: Callable[[], None] | None = None,
    hand_off: Callable[[dict | None, int], bool] | None = None,
    hand_off_after_s: float = 0.0,
) -> dict | None:
    """Run one tool call to its end and return the step result envelope.
    ``spare``: a ``warm_shim`` for a shell step (closed unused otherwise).
    ``while_running``: called once a shell step's shim (an http step's
    process) is started, before waiting for it (the caller's chance to get
    the next step ready); what it raises is logged, never the step's
    failure. ``hand_off`` and ``hand_off_after_s``: see ``attach.wait``;
    None when the step was handed off (still running after that time)."""
    started = time.time()
    try:
        directory, request = prepare_request(handle_id, tool=tool, params=params, timeout_s=timeout_s, attempt=attempt,
                                      plan=plan)
        if tool in ("shell", "http"):
            if tool == "shell":
                launched = launch(handle_id, request=request, spare=spare)
                spare = None  # started in, or closed by, launch
            else:
                launched = tool_process.launch(handle_id, tool=tool, attempt=attempt, run=lambda: _run_in_process(
                    handle_id, tool, params, timeout_s, attempt, directory, request["plan"], time.time()))
            if while_running is not None:
                try:
                    while_running()
                except Exception:
                    logger.exception("getting the next step ready failed; it starts the usual way")
            return wait(handle_id, cancel_requested=cancel_requested, on_progress=on_progress, launched=launched,
                        request=request, hand_off=hand_off, hand_off_after_s=hand_off_after_s)
    except EnvelopeError as exc:
        return failed_result(handle_id, exc.envelope, attempt=attempt, started_at=started, finished_at=time.time())
    except OSError as exc:
        error = error_envelope("internal", f"cannot start the step: {exc}", retryable=True)
        return failed_result(handle_id, error, attempt=attempt, started_at=started, finished_at=time.time())
    finally:
        if spare is not None:
            spare.close()  # unused: it exits when its link closes

    if cancel_requested is not None and cancel_requested():
        envelope = failed_result(
            handle_id, error_envelope("cancelled", "the step was cancelled before it started"),
            attempt=attempt, started_at=started, finished_at=time.time(),
        )  # fmt: skip
    else:
        envelope = _run_in_process(handle_id, tool, params, timeout_s, attempt, directory, request["plan"], started)
    write_json_atomic(directory / shim.RESULT_FILE, {"tool": tool, "envelope": envelope})
    return envelope


def _run_in_process(
    handle_id: str, tool: str, params: dict, timeout_s: float, attempt: int, directory: Path, plan: dict,
    started: float,
) -> dict:
    workspace = directory / WORKSPACE_DIR
    try:
        if tool == "http":
            output, details, error = http_tool.run(params, timeout_s=timeout_s, plan=plan, workspace=workspace,
                                                   directory=directory)
        else:
            output, details = file_tool.run(params, workspace=workspace)
            error = None
    except EnvelopeError as exc:
        return failed_result(handle_id, exc.envelope, attempt=attempt, started_at=started, finished_at=time.time())
    except OSError as exc:
        error = error_envelope("external_failure", f"{tool} failed: {exc}", details={"errno": exc.errno})
        return failed_result(handle_id, error, attempt=attempt, started_at=started, finished_at=time.time())
    status = "success" if error is None else "failed"
    return step_result(
        status=status,
        handle_id=handle_id,
        output=output,
        started_at=started,
        finished_at=time.time(),
        attempt=attempt,
        details=details,
        error=error,
    )
