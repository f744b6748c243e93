"""The Event outbox (docs/live-relay.md#outbox): rows written in the
transaction of the change they describe, read by every consumer from a
cursor (the row id)."""

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from django.utils import timezone

from runs.models import Event, EventType, Step
from runtime import statements

_held: ContextVar[list[Event] | None] = ContextVar("execgo_outbox_held", default=None)


def step_event(run_id: int, step: Step, type_: EventType, message: str, data: dict | None = None) -> Event:
    """An event about ``step``'s current attempt, not yet written."""
    return Event(type=type_, run_id=run_id, task_id=step.step_id, handle_id=step.handle_id,
                 timestamp=timezone.now(), message=message, data=data or {})


def emit(events: list[Event]) -> None:
    """Write ``events`` in order, in the caller's transaction (at the end of
    a ``written_at_the_end`` block, when inside one)."""
    held = _held.get()
    if held is not None:
        held.extend(events)
    else:
        statements.insert(events)


@contextmanager
def written_at_the_end() -> Iterator[list[Event]]:
    """Hold the events emitted inside the block and write them together as
    it ends without an error, in order, in the caller's transaction (which
    the block must end with, just before its commit). An id is handed out at
    insert and a row seen at commit: the live relay waits only so long for a
    lower id to commit (docs/live-relay.md), so a transaction that does a
    lot keeps its events' ids for its end. The caller drops what a rolled
    back part of the block emitted (the list yielded)."""
    held: list[Event] = []
    token = _held.set(held)
    try:
        yield held
    finally:
        _held.reset(token)
    statements.insert(held)


def emit_step_event(run_id: int, step: Step, type_: EventType, message: str, data: dict | None = None) -> None:
    emit([step_event(run_id, step, type_, message, data)])
