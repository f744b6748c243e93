"""kombu's Redis transport, with one of its reconnect races closed.

When Redis goes away, Celery's consumer releases its broker connection. The
connection's channel then restores the messages it holds unacknowledged,
and for that asks its transport for the connection's address. If the
transport has already lost its connection, kombu (5.7.0) raises
``AttributeError`` there, outside the errors Celery ignores while
reconnecting. Celery then logs "Unrecoverable error", and the worker stops
consuming for good. Its other threads keep the process alive, so no process
manager restarts it.

Here that restore gives up with a warning, and the consumer reconnects.
The messages stay in Redis's unacked set for kombu to restore after the
visibility timeout, unless Redis lost them with the rest of its data. A
run whose work a broker lost is sent again by the sweeper (``runs.sweeper``)
in either case.
"""

import logging

from kombu.transport import TRANSPORT_ALIASES, redis

logger = logging.getLogger(__name__)


class QoS(redis.QoS):
    def restore_unacked(self, client=None):
        try:
            super().restore_unacked(client)
        except AttributeError as exc:  # the transport's connection is gone: see the module docstring
            logger.warning("could not restore %d unacknowledged messages on a lost broker connection (%s); "
                           "Redis restores them after the visibility timeout", len(self._delivered), exc)
            self._delivered.clear()


class Channel(redis.Channel):
    QoS = QoS


class Transport(redis.Transport):
    Channel = Channel


def use_guarded_redis_transport() -> None:
    """Make ``redis://`` URLs resolve to this transport in this process."""
    TRANSPORT_ALIASES["redis"] = "execgo.redis_broker:Transport"
