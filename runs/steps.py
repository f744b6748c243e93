"""Step writes shared by settling a run and closing it: skipping steps that
will never run, and the envelope of an attempt that ended without running."""

from django.utils import timezone

from runs.models import EventType, Run, Step, StepStatus
from runs.outbox import emit_step_event
from runs.step_lifecycle import NO_ATTEMPT, step_set
from runtime.envelopes import failed_result


def skip_pending(run: Run, steps: list[Step], reason: str) -> None:
    """Mark the steps that never started skipped (compare-and-swap: a step
    dispatched meanwhile is left to its attempt)."""
    for step in steps:
        if step.status == StepStatus.PENDING and not step.run_status:
            if step_set(step, expect=(StepStatus.PENDING, NO_ATTEMPT), to=(StepStatus.SKIPPED, NO_ATTEMPT)):
                emit_step_event(run.pk, step, EventType.TASK_CANCELLED, f"skipped: {reason}", {"status": "skipped"})


def unstarted_result(step: Step, attempt: int, started, error: dict) -> dict:
    """The envelope of an attempt that ended without running."""
    return failed_result(step.handle_id, error, attempt=attempt, started_at=started, finished_at=timezone.now())
