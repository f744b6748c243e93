"""The Event outbox (docs/live-relay.md#outbox): rows written in the
transaction of the change they describe, read by every consumer from a
cursor (the row id)."""

from django.utils import timezone

from runs import recording
from runs.models import Event, EventType, Step
from runtime import statements


def step_event(run_id: int, step: Step, type_: EventType, message: str, data: dict | None = None) -> Event:
    """An event about ``step``'s current attempt, not yet written."""
    return Event(type=type_, run_id=run_id, task_id=step.step_id, handle_id=step.handle_id,
                 timestamp=timezone.now(), message=message, data=data or {})


def emit(events: list[Event]) -> None:
    """Write ``events`` in order, in the caller's transaction: at its end
    inside a ``transitions.recorded_at_the_end`` block. An id is handed out
    at insert and a row seen at commit: the live relay waits only so long
    for a lower id to commit (docs/live-relay.md), so a transaction that
    does a lot keeps its events' ids for its end."""
    held = recording.held()
    if held is not None:
        held.events.extend(events)
    else:
        statements.insert(events)


def emit_step_event(run_id: int, step: Step, type_: EventType, message: str, data: dict | None = None) -> None:
    emit([step_event(run_id, step, type_, message, data)])
