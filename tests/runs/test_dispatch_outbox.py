"""The dispatch outbox: what the broker did not take is kept and relayed,
oldest first, to the real broker; an expired message is dropped; a row
still on its way in its own commit's callback is left to it."""

from datetime import timedelta

import pytest
from django.utils import timezone

from execgo.celery import app
from runs.dispatch import ADVANCE_RUN, RELAY_AFTER, SETTLE_RUN, enqueue_advance, relay_dispatches
from runs.models import Dispatch
from tests.conftest import purge_broker

pytestmark = pytest.mark.django_db(transaction=True)


def taken_from_broker(limit: int = 10) -> list[tuple[str, list]]:
    """The (task, args) of the messages on the default queue, in order."""
    taken = []
    with app.connection_for_read() as connection:
        queue = connection.SimpleQueue("celery")
        try:
            while len(taken) < limit:
                message = queue.get(timeout=2)
                taken.append((message.headers["task"], list(message.decode()[0])))
                message.ack()
        except queue.Empty:
            pass
        finally:
            queue.close()
    return taken


def test_the_relay_sends_what_the_broker_had_not_taken_and_drops_what_expired():
    purge_broker()
    old = timezone.now() - RELAY_AFTER * 3
    first = Dispatch.objects.create(task=ADVANCE_RUN, args=[101], created_at=old, attempts=1, last_error="down")
    second = Dispatch.objects.create(task=SETTLE_RUN, args=[102], created_at=old + timedelta(milliseconds=1))
    expired = Dispatch.objects.create(task=SETTLE_RUN, args=[103], created_at=old,
                                      expires_at=timezone.now() - timedelta(seconds=1))
    # Its own commit's callback is about to send it: younger than RELAY_AFTER for the whole test, however slow.
    in_flight = Dispatch.objects.create(task=ADVANCE_RUN, args=[104], created_at=timezone.now() + timedelta(minutes=5))

    assert relay_dispatches() == 2
    assert list(Dispatch.objects.values_list("pk", flat=True)) == [in_flight.pk]
    assert taken_from_broker() == [(ADVANCE_RUN, [101]), (SETTLE_RUN, [102])]
    assert {first.pk, second.pk, expired.pk}.isdisjoint(Dispatch.objects.values_list("pk", flat=True))
    assert relay_dispatches() == 0  # nothing old enough is left


def test_a_durable_message_sent_at_commit_leaves_no_row():
    purge_broker()
    enqueue_advance(201, durable=True)  # autocommit: its commit is now
    assert not Dispatch.objects.exists()
    assert taken_from_broker() == [(ADVANCE_RUN, [201])]
