"""The live relay on SQLite: an idle web process does not read the Event
table at every poll; it looks at the database's commit counter first, and a
commit by any other connection still reaches the subscribers at once."""

import asyncio

import pytest
from channels.db import database_sync_to_async
from django.utils import timezone

from runs import relay as relay_module
from runs.models import Event, EventType
from tests.conftest import run_coroutine

pytestmark = pytest.mark.skipif(relay_module.connection.vendor != "sqlite",
                                reason="PostgreSQL wakes the relay by NOTIFY; the commit counter is SQLite's")


@pytest.mark.django_db(transaction=True)
def test_an_idle_relay_reads_no_rows_and_a_commit_still_reaches_it(make_run, settings, monkeypatch):
    settings.EXECGO_RELAY_POLL_S = 0.01
    run = make_run("EXECUTING")
    reads = []
    real_rows_after = relay_module.rows_after

    def counted_rows_after(cursor, **kwargs):
        reads.append(cursor)
        return real_rows_after(cursor, **kwargs)

    monkeypatch.setattr(relay_module, "rows_after", counted_rows_after)

    async def scenario():
        relay = relay_module.OutboxRelay()
        await relay.ensure_started()
        try:
            with relay.subscription(run.pk) as queue:
                await asyncio.sleep(0.5)  # fifty polls with nothing committed
                idle_reads = len(reads)
                event = await database_sync_to_async(Event.objects.create)(
                    type=EventType.TASK_PROGRESSED, run=run, timestamp=timezone.now(), message="hello")
                delivered = await asyncio.wait_for(queue.get(), 10)
                return idle_reads, event.pk, delivered
        finally:
            await relay.stop()

    idle_reads, event_id, delivered = run_coroutine(scenario)
    assert idle_reads == 1  # the first look only
    assert delivered["id"] == event_id and delivered["message"] == "hello"
    assert len(reads) >= 2


@pytest.mark.django_db(transaction=True)
def test_the_commit_stamp_changes_only_when_another_connection_commits(make_run):
    stamp = relay_module.CommitStamp()
    try:
        assert stamp.changed() is True  # the first look
        assert stamp.changed() is False
        make_run("EXECUTING")
        assert stamp.changed() is True
        assert stamp.changed() is False
    finally:
        stamp.close()
