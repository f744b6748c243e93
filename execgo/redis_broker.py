"""kombu's Redis transport, with one of its reconnect races closed.

When Redis goes away, Celery's consumer releases its broker connection, and
kombu clears the transport's link to it. A channel that still has work to
do on that connection (acknowledging a task that just finished, restoring
the messages it holds unacknowledged) then asks the transport for the
connection's address, and kombu (5.7.0) raises ``AttributeError`` there.
That is outside the errors Celery treats as a lost connection: the consumer
logs "Unrecoverable error" and stops consuming for good, while the worker's
other threads keep the process alive, so no process manager restarts it.

Here the channel reports a lost connection as what it is, redis's
``ConnectionError``, one of the transport's connection errors: Celery logs
the failed acknowledgement and reconnects. A message whose acknowledgement
or restore was lost stays in Redis's unacked set for kombu to restore after
the visibility timeout, unless Redis lost it with the rest of its data. A
run whose work a broker lost is sent again by the sweeper
(``runs.sweeper``) in either case, and a step delivered twice runs once
(the data plane's fence).
"""

import logging

from kombu.transport import TRANSPORT_ALIASES, redis
from redis.exceptions import ConnectionError as RedisConnectionError

logger = logging.getLogger(__name__)


class QoS(redis.QoS):
    def restore_unacked(self, client=None):
        try:
            super().restore_unacked(client)
        except RedisConnectionError as exc:  # the connection is gone: see the module docstring
            logger.warning("could not restore %d unacknowledged messages on a lost broker connection (%s); "
                           "Redis restores them after the visibility timeout", len(self._delivered), exc)
            self._delivered.clear()


class Channel(redis.Channel):
    QoS = QoS

    def _connparams(self, asynchronous=False):
        transport = self.connection
        if transport is None or transport.client is None:
            raise RedisConnectionError("the broker connection was released")
        return super()._connparams(asynchronous=asynchronous)


class Transport(redis.Transport):
    Channel = Channel


def use_guarded_redis_transport() -> None:
    """Make ``redis://`` URLs resolve to this transport in this process."""
    TRANSPORT_ALIASES["redis"] = "execgo.redis_broker:Transport"
