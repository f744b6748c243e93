"""The embedded default's broker: kombu's filesystem transport, with
messages published atomically.

kombu writes a message file in place (open, then lock, then write), and its
consumer moves files away without taking that advisory lock. A consumer
polling while a producer writes can therefore take an empty file: the
message is lost and the consumer's loop dies on the JSON error. Here the
message is written under a name the consumer never picks up (it matches
only ``*.<queue>.msg``) and renamed into place, which is atomic.
"""

import os
import uuid
from time import monotonic

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue, payload, **kwargs):
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        partial = f"{final}.partial"
        try:
            with open(partial, "wb") as file:
                file.write(str_to_bytes(dumps(payload)))
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel


def use_atomic_filesystem_transport() -> None:
    """Make ``filesystem://`` URLs resolve to this transport in this process."""
    TRANSPORT_ALIASES["filesystem"] = "execgo.broker:Transport"
