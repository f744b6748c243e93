"""The embedded default's broker: kombu's filesystem transport, made safe for
several processes producing and consuming at once.

kombu's own transport has three races, each of which loses or garbles work:

- **Messages** are written in place (open, then lock, then write), and the
  consumer moves files away without taking that advisory lock: a consumer
  polling while a producer writes takes an empty file, the message is lost
  and the consumer's loop dies on the JSON error. Here a message is written
  under a name no consumer picks up (it matches only ``*.<queue>.msg``) and
  renamed into place, which is atomic.
- **Exchange tables** (the bindings, one JSON file per exchange in the
  control folder) are created with ``open("wb")`` and only then locked, so a
  publisher's lookup that opens the file in between reads an empty table and
  its ``put`` raises ``JSONDecodeError``; two first binds both truncate the
  file and one binding is lost. Here every change to a table is a
  read-modify-write under an exclusive lock on a lock file of its own (never
  replaced), and the new table is renamed into place: a reader always sees a
  whole table, the old one or the new one, without taking a lock. And
  kombu skips a bind that its record of what is bound already holds, a
  record global to the process whatever the folder, and written before the
  table is: a second thread skipped its bind while the first was still
  writing the table, published, and its message was dropped (a message no
  binding routes is dropped without a word); a queue bound under one folder
  was never bound under the next one the process used; and a bind that
  failed once was never made again. Here every bind writes its binding into
  the table of its own folder (when the table lacks it) before it returns,
  whatever the process remembers.
- **Taking a message** moves it to the system's temporary directory, which
  on another filesystem is a copy and a delete: two consumers can both copy
  (and deliver) one message, or one can delete the copy the other is about
  to read. Here it is renamed into the processed folder (the same
  filesystem as the queue, see ``filesystem_transport_options``), and exactly one
  consumer's rename succeeds.

A message taken is deleted before it is acknowledged (as in kombu's own
transport): a worker killed while holding one loses it. The database is the
source of truth for that case, and the sweeper sends such a run's work again
(``runs.sweeper``).
"""

import fcntl
import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from queue import Empty
from time import monotonic_ns

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem, virtual
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads

exchange_queue_t = filesystem.exchange_queue_t


def _write_atomically(path: str, data: bytes) -> None:
    """``data`` at ``path`` in one step: written beside it under a name
    nobody reads, then renamed over it."""
    partial = f"{path}.{uuid.uuid4().hex}.partial"
    try:
        with open(partial, "wb") as file:
            file.write(data)
        os.replace(partial, path)
    except BaseException:
        try:
            os.unlink(partial)
        except FileNotFoundError:
            pass
        raise


class Channel(filesystem.Channel):
    # --- messages ---------------------------------------------------------

    def _put(self, queue, payload, **kwargs):
        # Taken in name order: the monotonic clock in nanoseconds, zero-padded
        # (milliseconds put messages of one millisecond in random order, and
        # unpadded numbers sort 1000 before 999).
        name = f"{monotonic_ns():020d}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        try:
            _write_atomically(final, str_to_bytes(dumps(payload)))
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc

    def _get(self, queue):
        wanted = f"{queue}.msg"
        for name in sorted(os.listdir(self.data_folder_in)):
            if name.partition(".")[2] != wanted:
                continue
            taken = os.path.join(self.processed_folder, name)
            try:
                os.rename(os.path.join(self.data_folder_in, name), taken)
            except FileNotFoundError:
                if not os.path.isdir(self.processed_folder):
                    raise ChannelError(f"The processed folder {self.processed_folder!r} is missing") from None
                continue  # another consumer took it first
            except OSError as exc:
                raise ChannelError(f"Cannot take {name!r} from the queue") from exc
            try:
                with open(taken, "rb") as file:
                    payload = file.read()
                if not self.store_processed:
                    os.remove(taken)
            except OSError as exc:
                raise ChannelError(f"Cannot read file {taken!r} from queue.") from exc
            return loads(bytes_to_str(payload))
        raise Empty()

    # --- exchange tables --------------------------------------------------

    def get_table(self, exchange):
        file = self._exchange_file(exchange)
        try:
            data = file.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise ChannelError(f"Cannot open {file}") from exc
        return [exchange_queue_t(*q) for q in loads(bytes_to_str(data))]

    @contextmanager
    def _table_locked(self, exchange) -> Iterator[str]:
        """The exchange's table file, with every other writer of it kept out."""
        file = self._exchange_file(exchange)
        self.control_folder.mkdir(exist_ok=True)
        try:
            lock = open(f"{file}.lock", "ab")
        except OSError as exc:
            raise ChannelError(f"Cannot open {file}.lock") from exc
        with lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            yield str(file)  # closing the file releases the lock

    def queue_bind(self, queue, exchange=None, routing_key="", arguments=None, **kwargs):
        # Not kombu's: it skips the table when the process's record says bound
        # (see the module's docstring). The table is the truth; the record is
        # kept only for queue_delete, and only once the table has the binding.
        exchange = exchange or "amq.direct"
        meta = self.typeof(exchange).prepare_bind(queue, exchange, routing_key, arguments)
        self._queue_bind(exchange, *meta)
        self.state.binding_declare(queue, exchange, routing_key, arguments)

    def _queue_bind(self, exchange, routing_key, pattern, queue):
        binding = exchange_queue_t(routing_key or "", pattern or "", queue or "")
        with self._table_locked(exchange) as file:
            queues = self.get_table(exchange)
            if binding not in queues:
                queues.insert(0, binding)
                self._write_table(file, queues)

    def _delete(self, queue, exchange, routing_key, pattern, *args, **kwargs):
        virtual.Channel._delete(self, queue, exchange, routing_key, pattern, *args, **kwargs)
        binding = exchange_queue_t(routing_key or "", pattern or "", queue or "")
        with self._table_locked(exchange) as file:
            queues = self.get_table(exchange)
            if binding in queues:
                queues.remove(binding)
                self._write_table(file, queues)

    @staticmethod
    def _write_table(file: str, queues: list) -> None:
        try:
            _write_atomically(file, str_to_bytes(dumps(queues)))
        except OSError as exc:
            raise ChannelError(f"Cannot write {file}") from exc


class Transport(filesystem.Transport):
    """kombu's filesystem transport, with the channel above, driven by a
    worker's event loop.

    Celery gives a transport that is not asynchronous its blocking consumer
    loop and, with it, billiard's threaded pool, whose processes take their
    tasks from one shared pipe under one lock shared by every pool process.
    The pool process waiting for the next task holds that lock while it
    waits: killed then (``kill -9``, the OOM killer), it never releases it,
    and no pool process takes a task again, so the worker stops for good.
    Driven by the event loop, the worker uses the pool it uses with Redis
    (each pool process has pipes of its own, the worker's main process
    writes each task to one of them). A folder has no file descriptor to
    wait on: the loop looks at the queues every ``polling_interval``.
    """

    Channel = Channel
    implements = filesystem.Transport.implements.extend(asynchronous=True)
    # A folder has no host: without this kombu warns, on every connection, that it "reverts to localhost".
    default_connection_params = {"port": None, "hostname": None}
    _poll_timer = None

    def register_with_event_loop(self, connection, loop):
        self.unregister_from_event_loop(connection, loop)  # a consumer restarted registers again
        self._poll_timer = loop.call_repeatedly(self.polling_interval, self._take_waiting, connection)

    def unregister_from_event_loop(self, connection, loop):
        if self._poll_timer is not None:
            self._poll_timer.cancel()
            self._poll_timer = None

    def _take_waiting(self, connection) -> None:
        """Deliver the messages waiting now, as many as the consumers'
        prefetch lets in (a channel whose prefetch is full takes none)."""
        while True:
            try:
                self.drain_events(connection, timeout=0)
            except socket.timeout:
                return


def use_atomic_filesystem_transport() -> None:
    """Make ``filesystem://`` URLs resolve to this transport in this process."""
    TRANSPORT_ALIASES["filesystem"] = "execgo.broker:Transport"


def filesystem_transport_options(broker_dir: Path, *, polling_interval: float) -> dict:
    """The CELERY_BROKER_TRANSPORT_OPTIONS of a ``filesystem://`` broker in
    ``broker_dir``, its folders made."""
    for sub in ("queue", "processed", "control"):
        (broker_dir / sub).mkdir(parents=True, exist_ok=True)
    # Reads and writes share one folder (producer and consumer are the same
    # app); the processed folder sits beside the queue so that taking a
    # message is one rename; the control folder must be absolute for
    # revoke/inspect to work.
    return {
        "data_folder_in": str(broker_dir / "queue"),
        "data_folder_out": str(broker_dir / "queue"),
        "processed_folder": str(broker_dir / "processed"),
        "control_folder": str(broker_dir / "control"),
        "store_processed": False,
        # The directory is listed on every poll; kombu's default of 1 s
        # would add up to a second to every hop of a run.
        "polling_interval": polling_interval,
    }
