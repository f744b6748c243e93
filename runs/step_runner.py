"""The seam between the harness and the execution data plane: "execute this
step attempt, give me its envelope"."""

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable

from django.conf import settings
from django.utils import timezone

from runs.errors import ErrorCode, error_envelope
from runs.models import Step


def current_host() -> str:
    return os.environ.get("EXECGO_HOST_NAME") or socket.gethostname()


def _iso(moment) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def run_tool(step: Step, *, attempt: int, timeout_s: float, cancel_requested: Callable[[], bool],
             on_progress: Callable[[int, str], None]) -> dict:
    params = step.params
    argv = params["argv"] if "argv" in params else ["/bin/sh", "-c", params["script"]]
    started = timezone.now()
    status, error, exit_code = "success", None, None
    cap = settings.EXECGO_OUTPUT_TAIL_BYTES
    stdout = stderr = b""
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError as exc:
        status = "failed"
        error = error_envelope(ErrorCode.INVALID_INPUT, f"cannot start {argv[0]!r}: {exc.strerror}",
                               source="executor", details={"argv0": argv[0]})
    else:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                stdout, stderr = proc.communicate(timeout=0.02)
                break
            except subprocess.TimeoutExpired:
                timed_out = time.monotonic() >= deadline
                if timed_out or cancel_requested():
                    os.killpg(proc.pid, signal.SIGKILL)
                    stdout, stderr = proc.communicate()
                    status = "failed" if timed_out else "cancelled"
                    error = (error_envelope(ErrorCode.TIMEOUT, f"step exceeded timeout {int(timeout_s * 1000)}ms",
                                            source="executor", details={"timeout_ms": int(timeout_s * 1000)})
                             if timed_out else error_envelope(ErrorCode.CANCELLED, "step cancelled", source="executor"))
                    break
        exit_code = proc.returncode
        if error is None and exit_code != 0:
            status = "failed"
            error = error_envelope(ErrorCode.EXTERNAL_FAILURE, f"command exited with status {exit_code}",
                                   source="executor", details={"exit_code": exit_code})
    finished = timezone.now()
    return {
        "status": status, "handle_id": step.handle_id,
        "output": {"exit_code": exit_code, "stdout": stdout[-cap:].decode("utf-8", "replace")},
        "started_at": _iso(started), "finished_at": _iso(finished),
        "duration_ms": int((finished - started).total_seconds() * 1000), "attempt": attempt,
        "details": {"exit_code": exit_code, "stderr": stderr[-cap:].decode("utf-8", "replace")},
        "error": error,
    }
