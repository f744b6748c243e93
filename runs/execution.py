"""EXECUTING: run a run's steps and decide which edge the run takes next.

Steps run in the plan's dependency order. Each execution is claimed by a
compare-and-swap on the step row, so a redelivered task never runs a step
twice; results and events commit together.
"""

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from runs.errors import ErrorCode, error_envelope
from runs.models import Event, EventType, Run, Step, StepRunStatus, StepStatus, TraceKind
from runs.statemachine import RunState

S = RunState
CANCEL_POLL_S = 0.05


@dataclass
class Outcome:
    """Which edge EXECUTING takes, and what to record with it."""

    target: RunState
    caller: str = "tool controller"
    actor: Any = None
    error: dict | None = None
    trace_kind: str = TraceKind.TOOL_INVOCATION
    trace_data: dict = field(default_factory=dict)
    step: Step | None = None


def _iso(moment) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def _cancel_requester(run_id: int):
    row = Run.objects.filter(pk=run_id).values_list("cancel_requested_at", "cancel_requested_by").first()
    if row is None or row[0] is None:
        return None
    return row


def execute_steps(run: Run) -> Outcome:
    deadline = run.executing_started_at + timedelta(seconds=run.timeout_s)
    steps = list(run.steps.order_by("position"))
    succeeded = {step.step_id for step in steps if step.status == StepStatus.SUCCESS}
    for index, step in enumerate(steps):
        if step.status == StepStatus.SUCCESS:
            continue  # resumed run: done before
        if _cancel_requester(run.pk) is not None:
            _skip(run, steps[index:], reason="run cancelled")
            return _cancelled(run)
        remaining = (deadline - timezone.now()).total_seconds()
        if remaining <= 0:
            _skip(run, steps[index:], reason="run timed out")
            return Outcome(S.TIMEOUT, trace_kind=TraceKind.RUN,
                           error=error_envelope(ErrorCode.TIMEOUT, f"run exceeded timeout {run.timeout_s}s",
                                                source="scheduler", details={"timeout_s": run.timeout_s,
                                                                             "layer": "harness"}),
                           trace_data={"timeout_s": run.timeout_s, "layer": "harness"})
        if not set(step.depends_on) <= succeeded:
            continue
        result = _run_step(run, step, time_budget_s=min(step.timeout_s, remaining))
        if result["status"] == StepRunStatus.SUCCESS:
            succeeded.add(step.step_id)
            continue
        _skip(run, steps[index + 1:], reason=f"dependency {step.step_id} failed")
        if result["status"] == StepRunStatus.CANCELLED:
            return _cancelled(run)
        return Outcome(S.FAILED, error=result["error"], step=step,
                       trace_data={"tool": step.tool, "step": step.step_id, "retry_count": step.attempt - 1})
    return Outcome(S.TRACING)


def _cancelled(run: Run) -> Outcome:
    run.refresh_from_db(fields=["cancel_requested_by"])
    return Outcome(S.CANCELLED, caller="user", actor=run.cancel_requested_by, trace_kind=TraceKind.RUN,
                   trace_data={"cancelled_by": run.cancel_requested_by_id})


def _skip(run: Run, steps: list[Step], *, reason: str) -> None:
    pending = [step.pk for step in steps if step.status == StepStatus.PENDING]
    if not pending:
        return
    with transaction.atomic():
        Step.objects.filter(pk__in=pending, status=StepStatus.PENDING).update(status=StepStatus.SKIPPED)
        Event.objects.bulk_create(
            Event(type=EventType.TASK_CANCELLED, run=run, task_id=step.step_id, timestamp=timezone.now(),
                  message=f"skipped: {reason}", data={"status": StepStatus.SKIPPED})
            for step in steps if step.pk in pending
        )


def _event(run: Run, step: Step, type_: str, message: str, data: dict | None = None) -> Event:
    return Event.objects.create(type=type_, run=run, task_id=step.step_id, handle_id=step.handle_id,
                                timestamp=timezone.now(), message=message, data=data or {})


def _run_step(run: Run, step: Step, *, time_budget_s: float) -> dict:
    result: dict = {}
    for attempt in range(1, step.retries + 2):
        handle_id = f"h-{step.pk}-{attempt}"
        with transaction.atomic():
            claimed = Step.objects.filter(pk=step.pk, status__in=[StepStatus.PENDING, StepStatus.RUNNING],
                                          attempt=attempt - 1).update(
                status=StepStatus.RUNNING, run_status=StepRunStatus.ACCEPTED, attempt=attempt,
                handle_id=handle_id, started_at=timezone.now(),
            )
            if not claimed:  # another delivery of this task already ran it
                step.refresh_from_db()
                return step.result or {"status": step.run_status, "error": None}
            step.refresh_from_db()
            _event(run, step, EventType.TASK_ACCEPTED, "accepted", {"attempt": attempt})
        started = timezone.now()
        with transaction.atomic():
            Step.objects.filter(pk=step.pk).update(run_status=StepRunStatus.RUNNING)
            _event(run, step, EventType.TASK_STARTED, "started", {"attempt": attempt})
        result = _execute_shell(step, handle_id=handle_id, attempt=attempt, started=started,
                                timeout_s=time_budget_s, cancelled=lambda: _cancel_requester(run.pk) is not None)
        final_attempt = (result["status"] != StepRunStatus.FAILED or not result["error"]["retryable"]
                         or attempt == step.retries + 1)
        with transaction.atomic():
            status = {StepRunStatus.SUCCESS: StepStatus.SUCCESS}.get(result["status"], StepStatus.FAILED)
            Step.objects.filter(pk=step.pk).update(
                run_status=result["status"], result=result, finished_at=timezone.now(),
                status=status if final_attempt else StepStatus.RUNNING,
            )
            event_type = {StepRunStatus.SUCCESS: EventType.TASK_SUCCEEDED,
                          StepRunStatus.CANCELLED: EventType.TASK_CANCELLED}.get(result["status"],
                                                                                 EventType.TASK_FAILED)
            _event(run, step, event_type, result["error"]["message"] if result["error"] else "succeeded",
                   {"attempt": attempt, "duration_ms": result["duration_ms"]})
            if not final_attempt:
                _event(run, step, EventType.TASK_RETRIED, f"retrying after attempt {attempt}",
                       {"attempt": attempt + 1})
        step.refresh_from_db()
        if final_attempt:
            return result
        time.sleep(min(0.1 * 2 ** (attempt - 1), 2.0))
    return result


def _execute_shell(step: Step, *, handle_id: str, attempt: int, started, timeout_s: float, cancelled) -> dict:
    argv = step.params["argv"] if "argv" in step.params else ["/bin/sh", "-c", step.params["script"]]
    status, error, exit_code = StepRunStatus.SUCCESS, None, None
    cap = settings.EXECGO_OUTPUT_TAIL_BYTES
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError as exc:
        stdout = stderr = b""
        status = StepRunStatus.FAILED
        error = error_envelope(ErrorCode.INVALID_INPUT, f"cannot start {argv[0]!r}: {exc.strerror}",
                               source="executor", details={"argv0": argv[0]})
    else:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                stdout, stderr = proc.communicate(timeout=CANCEL_POLL_S)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline or cancelled():
                    timed_out = time.monotonic() >= deadline
                    os.killpg(proc.pid, signal.SIGKILL)
                    stdout, stderr = proc.communicate()
                    status = StepRunStatus.FAILED if timed_out else StepRunStatus.CANCELLED
                    error = (error_envelope(ErrorCode.TIMEOUT, f"step exceeded timeout {int(timeout_s * 1000)}ms",
                                            source="executor", details={"timeout_ms": int(timeout_s * 1000)})
                             if timed_out else
                             error_envelope(ErrorCode.CANCELLED, "step cancelled", source="executor"))
                    break
        exit_code = proc.returncode
        if error is None and exit_code != 0:
            status = StepRunStatus.FAILED
            error = error_envelope(ErrorCode.EXTERNAL_FAILURE, f"command exited with status {exit_code}",
                                   source="executor", details={"exit_code": exit_code})
    finished = timezone.now()
    return {
        "status": status,
        "handle_id": handle_id,
        "output": {"exit_code": exit_code, "stdout": stdout[-cap:].decode("utf-8", "replace")},
        "started_at": _iso(started),
        "finished_at": _iso(finished),
        "duration_ms": int((finished - started).total_seconds() * 1000),
        "attempt": attempt,
        "details": {"exit_code": exit_code, "stderr": stderr[-cap:].decode("utf-8", "replace")},
        "error": error,
    }
