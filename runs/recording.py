"""What a transaction records of its changes, held to its end.

A change of a run is recorded in rows of four kinds: its events (the
outbox), traces, audit rows and the projection of its job. Inside a
``holding`` block (opened by ``runs.transitions.recorded_at_the_end``) the
writers of those rows (``outbox.emit``, ``audit.audit``, the transition's
own trace and projection) hand them here instead of writing each at once,
and they are written together as the block ends: on PostgreSQL the audit
chain's head in one round trip, everything else in another
(``runtime.statements.write_together``), where each transition cost five
before. The rows keep the order they were recorded in, and their times
are those of the change, not of the write.

Nothing of the block reads what it holds, but for one reader, the summary a
run's close computes from its traces: it writes the held rows first
(``transitions.write_held``). A part of the block rolled back to a
savepoint and caught leaves behind what it recorded: the blocks are those
whose parts either raise out of them or record nothing before they fail.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from runs.models import AuditLog, Event, Trace


@dataclass
class Held:
    events: list[Event] = field(default_factory=list)
    traces: list[Trace] = field(default_factory=list)
    audit_rows: list[AuditLog] = field(default_factory=list)
    # (job id, run id) -> the projection's values: the last one recorded wins.
    jobs: dict[tuple[int, int], dict] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.events or self.traces or self.audit_rows or self.jobs)

    def taken(self) -> "Held":
        """What is held, handed over to be written; this is left empty."""
        taken = Held(self.events, self.traces, self.audit_rows, self.jobs)
        self.events, self.traces, self.audit_rows, self.jobs = [], [], [], {}
        return taken


_held: ContextVar[Held | None] = ContextVar("execgo_recording_held", default=None)


def held() -> Held | None:
    """The rows held by the ``holding`` block this code runs in, if any."""
    return _held.get()


@contextmanager
def holding() -> Iterator[Held]:
    """Hold what is recorded inside the block, for the caller to write."""
    rows = Held()
    token = _held.set(rows)
    try:
        yield rows
    finally:
        _held.reset(token)
