"""The live relay: committed Event rows → this web process's websocket groups.

One tail of the outbox per web process, whatever the deployment: the Event
table is read from a cursor (its id), and each row is sent to the process's
own groups (``run-<id>`` for every event, ``runs-<tenant>`` for state
changes, and ``approvals-<tenant>`` for a run entering or leaving
AWAITING_HITL and for an edit of a pending request's plan). The groups live on an in-process channel layer (the ``relay``
alias): every web process tails the table itself, so no event is sent twice
through a shared layer, and a worker never needs to reach a web process.

The tail is woken by PostgreSQL's NOTIFY (a trigger on the Event table; it
is delivered at commit) and otherwise reads every ``EXECGO_RELAY_POLL_S``
(SQLite, the embedded default, or a lost listener connection). On SQLite
each of those looks first asks the database whether anything committed
since the last one (``PRAGMA data_version``, no table read), so an idle
process stays idle.

Ids are handed out at insert and rows become visible at commit, so on
PostgreSQL a row can appear after a higher id did. The cursor therefore
stops at a hole and waits for it up to ``EXECGO_RELAY_GAP_WAIT_S``, after
which the hole is taken for a rolled-back insert: events go out in id order
and the cursor is a valid resume point for every consumer.
"""

import asyncio
import contextvars
import logging
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import connection
from psycopg.conninfo import make_conninfo

from runs.metrics import EVENTS_RELAYED
from runs.models import Event, EventType, Run
from runs.selectors import LIVE_EVENT_FIELDS, latest_event_id
from runs.statemachine import RunState

logger = logging.getLogger(__name__)

RELAY_LAYER = "relay"
NOTIFY_CHANNEL = "execgo_events"
BATCH = 500


def run_group(run_id: int) -> str:
    return f"run-{run_id}"


def runs_group(tenant_id: int) -> str:
    return f"runs-{tenant_id}"


def approvals_group(tenant_id: int) -> str:
    return f"approvals-{tenant_id}"


def event_payload(row: dict) -> dict:
    """An Event row as the browser receives it."""
    return {
        "id": row["id"], "type": row["type"], "run_id": row["run_id"], "task_id": row["task_id"],
        "handle_id": row["handle_id"], "timestamp": row["timestamp"].isoformat(), "message": row["message"],
        "data": row["data"],
    }


def groups_for(row: dict) -> list[str]:
    groups = [run_group(row["run_id"])]
    if row["type"] == EventType.RUN_STATE_CHANGED and row["run__tenant_id"] is not None:
        groups.append(runs_group(row["run__tenant_id"]))
        if RunState.AWAITING_HITL in (row["data"].get("from"), row["data"].get("to")):
            groups.append(approvals_group(row["run__tenant_id"]))
    elif row["type"] == EventType.APPROVAL_CHANGED and row["run__tenant_id"] is not None:
        groups.append(approvals_group(row["run__tenant_id"]))  # the inbox shows what each request will run
    return groups


def rows_after(cursor: int, *, limit: int = BATCH) -> list[dict]:
    """The events after ``cursor``, each with its run's tenant. Two reads of
    one table each, not a join: a statement holding one table's lock while
    it waits for the other's deadlocks with one that takes them the other
    way round (a TRUNCATE, a migration's ALTER TABLE)."""
    rows = list(Event.objects.filter(pk__gt=cursor).order_by("pk").values(*LIVE_EVENT_FIELDS)[:limit])
    runs = {row["run_id"] for row in rows}
    tenants = dict(Run.objects.filter(pk__in=runs).values_list("pk", "tenant_id")) if runs else {}
    for row in rows:
        row["run__tenant_id"] = tenants.get(row["run_id"])  # None: the run was deleted since
    return rows


class CommitStamp:
    """Whether another connection committed to the SQLite database since the
    last look: ``PRAGMA data_version`` on a connection of its own, which
    never writes (the number changes at every other connection's commit).
    Not an SQLite file (an in-memory database): always "changed"."""

    def __init__(self) -> None:
        self._connection: sqlite3.Connection | None = None
        self._version: int | None = None
        name = str(connection.settings_dict["NAME"])
        if connection.vendor == "sqlite" and name != ":memory:" and not name.startswith("file:"):
            try:
                self._connection = sqlite3.connect(f"file:{name}?mode=ro", uri=True, timeout=0,
                                                   check_same_thread=False, isolation_level=None)
            except sqlite3.Error:
                logger.warning("outbox relay: cannot watch %s for commits; reading at every poll", name)

    def changed(self) -> bool:
        if self._connection is None:
            return True
        try:
            version = self._connection.execute("PRAGMA data_version").fetchone()[0]
        except sqlite3.Error:
            return True
        changed, self._version = version != self._version, version
        return changed

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()


class OutboxRelay:
    """The tail of this process (see the module docstring). ``cursor`` is
    the id of the last event sent; everything up to it has been sent."""

    def __init__(self) -> None:
        self.cursor: int | None = None
        self.sent = 0
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._hole_since: tuple[int, float] | None = None  # (first missing id, when first seen)
        # The API's waiting views of this process, by run: each gets the run's events.
        self._subscribers: dict[int, set[asyncio.Queue]] = {}

    @contextmanager
    def subscription(self, run_id: int) -> Iterator[asyncio.Queue]:
        """A queue of ``run_id``'s events (payloads) from now on, in order."""
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers.setdefault(run_id, set()).add(queue)
        try:
            yield queue
        finally:
            queues = self._subscribers.get(run_id, set())
            queues.discard(queue)
            if not queues:
                self._subscribers.pop(run_id, None)

    async def ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        # One tail per process, on the server's loop (a test's loop may end under it).
        if self._task is not None and not self._task.done() and self._loop is loop:
            return
        self._loop = loop
        self._wake = asyncio.Event()
        self.cursor = await database_sync_to_async(latest_event_id)()
        # A fresh context: the tail outlives the request that started it, and
        # must not log with that request's ids (structlog's contextvars).
        self._task = loop.create_task(self._run(), name="execgo-outbox-relay", context=contextvars.Context())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        listener, stamp, holding = None, None, False
        if connection.vendor == "postgresql":
            listener = asyncio.get_running_loop().create_task(self._listen(), name="execgo-outbox-listen")
        else:
            stamp = CommitStamp()
        try:
            while True:
                # Read before the drain: a commit after the look is seen by the next one.
                if stamp is None or stamp.changed() or holding or self._wake.is_set():
                    try:
                        holding = await self._drain()
                    except Exception:  # a database hiccup must not end the relay of this process
                        logger.exception("outbox relay: reading events failed; retrying")
                        holding = False
                timeout = settings.EXECGO_RELAY_HOLE_POLL_S if holding else settings.EXECGO_RELAY_POLL_S
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except TimeoutError:
                    pass
                self._wake.clear()
        finally:
            if listener is not None:
                listener.cancel()
            if stamp is not None:
                stamp.close()

    async def _drain(self) -> bool:
        """Send what committed since the cursor; True while waiting on a hole."""
        layer = get_channel_layer(RELAY_LAYER)
        while True:
            rows = await database_sync_to_async(rows_after)(self.cursor)
            for row in rows:
                if row["id"] != self.cursor + 1 and not self._hole_expired(self.cursor + 1):
                    return True
                self._hole_since = None
                self.cursor = row["id"]
                message = {"type": "relay.event", "event": event_payload(row)}
                for group in groups_for(row):
                    await layer.group_send(group, message)
                for queue in self._subscribers.get(row["run_id"], ()):
                    queue.put_nowait(message["event"])
                self.sent += 1
                EVENTS_RELAYED.inc()
            if len(rows) < BATCH:
                return False

    def _hole_expired(self, missing: int) -> bool:
        now = time.monotonic()
        if self._hole_since is None or self._hole_since[0] != missing:
            self._hole_since = (missing, now)
        return now - self._hole_since[1] >= settings.EXECGO_RELAY_GAP_WAIT_S

    async def _listen(self) -> None:
        db = connection.settings_dict
        conninfo = make_conninfo(
            dbname=db["NAME"], user=db["USER"] or None, password=db["PASSWORD"] or None,
            host=db["HOST"] or None, port=db["PORT"] or None,
        )
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as listen:
                    await listen.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    self._wake.set()  # whatever committed while not listening
                    async for _notify in listen.notifies():
                        self._wake.set()
            except (psycopg.Error, OSError) as exc:
                logger.warning("outbox relay: LISTEN connection lost (%s); polling until it is back", exc)
                await asyncio.sleep(1.0)


relay = OutboxRelay()
