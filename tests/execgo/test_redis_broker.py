"""A worker's consumer survives a channel that loses its transport's
connection while it holds unacknowledged messages (execgo/redis_broker.py):
kombu 5.7.0 raised AttributeError there, whether restoring the messages or
acknowledging one, and Celery's consumer stopped for good."""

import logging

import pytest
from kombu import Connection, Exchange, Queue

from execgo.redis_broker import Transport

URL = "redis://127.0.0.1:6379/14"
QUEUE = Queue("execgo-test-redis-broker", Exchange("execgo-test-redis-broker"), "held")


@pytest.fixture
def held():
    """A channel holding one message unacknowledged, whose transport then
    lost its connection, as kombu leaves it when the broker went away first."""
    with Connection(URL) as connection:
        channel = connection.channel()
        QUEUE(channel).declare()
        connection.Producer(channel).publish({"n": 1}, exchange=QUEUE.exchange, routing_key="held",
                                             declare=[QUEUE])
        message = QUEUE(channel).get(no_ack=False)
        assert message is not None and channel.qos._delivered
        transport = connection.transport
        transport.client = None
        yield channel, message
        transport.client = connection
    with Connection(URL) as connection:
        QUEUE(connection.channel()).purge()


def test_redis_urls_resolve_to_the_guarded_transport():
    with Connection(URL) as connection:
        assert type(connection.transport) is Transport


def test_closing_the_channel_does_not_raise(held):
    channel, _ = held
    channel.close()  # restores the unacknowledged message: raised AttributeError before
    assert not channel.qos._delivered


def test_an_acknowledgement_fails_as_a_connection_error_that_celery_logs_and_survives(held, caplog):
    channel, message = held
    channel.close()  # the consumer released the connection; the task's acknowledgement comes after
    with pytest.raises(channel.connection_errors):
        message.ack()
    # Celery acknowledges through ack_log_error with the transport's connection errors:
    # logged, not raised (an AttributeError went through and stopped the consumer).
    with caplog.at_level(logging.CRITICAL):
        message.ack_log_error(logging.getLogger("test"), channel.connection_errors)
    assert "Couldn't ack" in caplog.text
    assert message.acknowledged is False
