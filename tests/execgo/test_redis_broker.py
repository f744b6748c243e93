"""A worker's consumer survives a channel that loses its transport's
connection while it holds unacknowledged messages (execgo/redis_broker.py):
kombu 5.7.0 raised AttributeError there, and Celery's consumer stopped for
good."""

from kombu import Connection, Exchange, Queue

from execgo.redis_broker import Transport

URL = "redis://127.0.0.1:6379/14"


def test_redis_urls_resolve_to_the_guarded_transport():
    with Connection(URL) as connection:
        assert type(connection.transport) is Transport


def test_a_channel_closed_after_its_transport_lost_the_connection_does_not_raise():
    queue = Queue("execgo-test-redis-broker", Exchange("execgo-test-redis-broker"), "held")
    with Connection(URL) as connection:
        channel = connection.channel()
        queue(channel).declare()
        producer = connection.Producer(channel)
        producer.publish({"n": 1}, exchange=queue.exchange, routing_key="held", declare=[queue])
        message = queue(channel).get(no_ack=False)  # held, unacknowledged
        assert message is not None and channel.qos._delivered
        connection.transport.client = None  # as kombu leaves it when the broker went away first
        channel.close()  # restores the unacknowledged message: raised AttributeError before
        assert not channel.qos._delivered
    with Connection(URL) as connection:
        queue(connection.channel()).purge()
