"""The embedded default's broker under concurrency: a consumer never takes a
message that is still being written, a publisher never reads a half-written
exchange table, concurrent binds keep every binding, and two consumers never
both take one message."""

import multiprocessing
import subprocess
import sys
import threading
import time

import pytest
from kombu import Connection, Exchange, Queue
from kombu.exceptions import ChannelError

from execgo.broker import Transport
from execgo.celery import app

# The filesystem transport, on folders of the tests' own whatever the stack.
pytestmark = pytest.mark.stack_free


def _options(folder) -> dict:
    (folder / "control").mkdir(parents=True, exist_ok=True)
    (folder / "processed").mkdir(exist_ok=True)
    return {"data_folder_in": str(folder), "data_folder_out": str(folder), "polling_interval": 0.001,
            "control_folder": str(folder / "control"), "processed_folder": str(folder / "processed")}


@pytest.fixture
def folder_connection(tmp_path):
    with Connection("filesystem://", transport_options=_options(tmp_path)) as connection:
        yield connection, tmp_path


# The binders' and consumers' processes, forked from one server process that
# imported this module once (a "spawn" start imports it again for each one).
PROCESSES = multiprocessing.get_context("forkserver")
PROCESSES.set_forkserver_preload([__name__])


@pytest.fixture(scope="module")
def cpu_load():
    """Both cores kept busy, so the broker's processes are preempted mid-write."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for burner in burners:
        burner.kill()
        burner.wait()


def test_filesystem_urls_use_the_atomic_transport(settings):
    with Connection("filesystem://") as connection:
        assert isinstance(connection.transport, Transport)
    if settings.CELERY_BROKER_URL.startswith("filesystem://"):
        with app.connection_for_write() as connection:
            assert isinstance(connection.transport, Transport)


def test_a_message_being_written_is_not_taken(folder_connection):
    connection, folder = folder_connection
    queue = connection.SimpleQueue("jobs")
    (folder / "1_half-written.jobs.msg.partial").write_bytes(b"")  # what a writer holds mid-write
    queue.put({"n": 1})
    assert queue.get(timeout=2).payload == {"n": 1}
    with pytest.raises(queue.Empty):
        queue.get(timeout=0.2)
    assert (folder / "1_half-written.jobs.msg.partial").exists()
    assert not list(folder.glob("*.jobs.msg"))


def test_a_queue_is_first_in_first_out(folder_connection):
    """Messages put in a burst (many in one millisecond) come out in the
    order they went in."""
    connection, folder = folder_connection
    queue = connection.SimpleQueue("fifo")
    for n in range(500):
        queue.put({"n": n})
    taken = []
    for _ in range(500):
        message = queue.get(timeout=2)
        taken.append(message.payload["n"])
        message.ack()
    assert taken == list(range(500))


def test_a_wait_lasts_as_long_as_its_caller_asked(folder_connection):
    """A get (or a ping's wait for replies) is not cut short by the slices a
    wait is made of: a message put 0.8 s into a 20 s wait is received."""
    connection, _ = folder_connection
    queue = connection.SimpleQueue("patient")
    with connection.clone() as sender:  # cloned in this thread (see _flood)
        later = threading.Timer(0.8, lambda: sender.SimpleQueue("patient").put({"n": 1}))
        later.start()
        try:
            assert queue.get(timeout=20).payload == {"n": 1}
        finally:
            later.join()


def test_a_worker_takes_the_folder_s_messages_from_its_event_loop(folder_connection):
    """The transport says it is asynchronous, so a worker drives it from its
    event loop (with the pool whose processes have pipes of their own:
    tests/runs/test_pool_child_kill.py): a timer of the loop delivers what
    is in the folder, and stops once the transport is unregistered."""
    from kombu import Consumer, Producer
    from kombu.asynchronous import Hub

    connection, _ = folder_connection
    assert connection.transport.implements.asynchronous  # what a Celery worker asks before using its event loop
    queue, received = Queue("looped"), []
    consumer = Consumer(connection.channel(), [queue], accept=["json"],
                        callbacks=[lambda body, message: (received.append(body), message.ack())])
    consumer.consume()
    producer = Producer(connection.clone().channel())
    hub = Hub()
    loop = hub.create_loop()
    try:
        connection.transport.register_with_event_loop(connection.connection, hub)
        producer.publish({"n": 1}, routing_key="looped", declare=[queue])
        deadline = time.monotonic() + 10
        while not received and time.monotonic() < deadline:
            next(loop)
        assert received == [{"n": 1}]

        connection.transport.unregister_from_event_loop(connection.connection, hub)
        producer.publish({"n": 2}, routing_key="looped")
        for _ in range(20):
            next(loop)
        assert received == [{"n": 1}]
    finally:
        producer.channel.connection.client.close()
        hub.close()


def _flood(connection, sent: int, name: str = "flood") -> list[int]:
    """``sent`` messages from a producer thread that binds the queue while
    the consumer binds it too (the exchange table does not exist yet). A
    producer that fails is reported as it failed: the consumer stops waiting
    as soon as the producer is gone, and its exception is raised here."""
    failed = []
    # Cloned here, not in the producer's thread: a kombu connection is not
    # shared between threads, and a clone reads the connection's transport,
    # which its first use makes. Made by both threads at once, the consumer
    # was left draining a transport that held none of its channels.
    producer_connection = connection.clone()

    def produce():
        try:
            with producer_connection:
                queue = producer_connection.SimpleQueue(name)
                for n in range(sent):
                    queue.put({"n": n})
        except BaseException as exc:
            failed.append(exc)  # raised in the test's thread below

    producer = threading.Thread(target=produce, name=f"producer of {name}")
    producer.start()
    received = []
    try:
        queue = connection.SimpleQueue(name)
        deadline = time.monotonic() + 30  # for the next message
        while len(received) < sent:
            try:
                message = queue.get(timeout=0.5)
            except queue.Empty:
                if not producer.is_alive() and not failed:
                    # Everything the producer sent is in the folder by now: what is not there was dropped.
                    try:
                        message = queue.get(timeout=2)
                    except queue.Empty:
                        pytest.fail(f"the producer finished, yet only {len(received)} of {sent} messages arrived")
                elif failed or time.monotonic() > deadline:
                    break
                else:
                    continue
            received.append(message.payload["n"])
            message.ack()
            deadline = time.monotonic() + 30
    finally:
        producer.join(timeout=60)
    if failed:
        raise AssertionError(f"the producer failed after {len(received)} of {sent} messages") from failed[0]
    assert not producer.is_alive(), "the producer is stuck"
    assert len(received) == sent, f"no message for 30 s: {len(received)} of {sent} arrived"
    return received


def test_a_queue_bound_under_another_folder_is_bound_under_this_one(tmp_path):
    """The transport's record of what is bound belongs to the process, not to
    a folder: a queue bound under one folder (an earlier test's, another
    settings' broker) was taken as bound under the next, whose table never
    got the binding, and what was sent there was dropped."""
    for folder in (tmp_path / "first", tmp_path / "second"):
        with Connection("filesystem://", transport_options=_options(folder)) as connection:
            queue = connection.SimpleQueue("one-name-two-folders")
            queue.put({"n": 1})
            assert queue.get(timeout=2).payload == {"n": 1}


def test_a_bind_that_failed_is_not_taken_as_made(tmp_path, monkeypatch):
    """A bind that fails before its table is written (a full disk, a missing
    folder) leaves no record that it was made: the next bind of that queue
    writes the table, and what is sent then arrives (it was dropped, in every
    connection of the process)."""
    from execgo import broker

    write_table = broker.Channel._write_table

    def full_disk_once(file, queues):
        monkeypatch.setattr(broker.Channel, "_write_table", staticmethod(write_table))
        raise ChannelError(f"Cannot write {file}")

    monkeypatch.setattr(broker.Channel, "_write_table", staticmethod(full_disk_once))
    with Connection("filesystem://", transport_options=_options(tmp_path)) as connection:
        with pytest.raises(ChannelError):
            connection.SimpleQueue("failed-bind")
        queue = connection.SimpleQueue("failed-bind")
        queue.put({"n": 1})
        assert queue.get(timeout=2).payload == {"n": 1}


def test_a_producer_that_fails_is_reported_at_once(folder_connection, monkeypatch):
    """The flood's own harness: a producer that fails makes the test fail
    with its exception, without the consumer waiting out its 30 s."""
    from execgo import broker

    def full_disk(self, queue, payload, **kwargs):
        raise ChannelError("Cannot add file to directory")

    monkeypatch.setattr(broker.Channel, "_put", full_disk)
    connection, _ = folder_connection
    started = time.monotonic()
    with pytest.raises(AssertionError, match="the producer failed after 0 of 10") as failure:
        _flood(connection, 10, name="flood-failing")
    assert isinstance(failure.value.__cause__, ChannelError)
    assert time.monotonic() - started < 15


def test_a_busy_producer_and_consumer_lose_nothing(folder_connection):
    connection, _ = folder_connection
    assert sorted(_flood(connection, 2000, name="flood-busy")) == list(range(2000))


@pytest.mark.parametrize("repeat", range(100))
def test_a_first_bind_under_load_garbles_nothing(tmp_path, cpu_load, repeat):
    """The race of the first bind: a publisher looking the binding up while
    the table is being created read an empty file (``JSONDecodeError``), or
    no table at all (the message dropped as undeliverable)."""
    with Connection("filesystem://", transport_options=_options(tmp_path)) as connection:
        assert sorted(_flood(connection, 100, name=f"first-bind-{repeat}")) == list(range(100))


def _bind(folder, queue: str, barrier) -> None:
    with Connection("filesystem://", transport_options=_options(folder)) as connection:
        barrier.wait()
        Queue(queue, Exchange("shared", "direct"), routing_key=queue)(connection.default_channel).declare()


def test_concurrent_first_binds_keep_every_binding(tmp_path, cpu_load):
    """Processes binding their own queues to one new exchange at once: each
    binding is in the table afterwards (a truncating first bind lost some)."""
    context = PROCESSES
    for repeat in range(10):
        folder = tmp_path / str(repeat)
        barrier = context.Barrier(6)
        binders = [context.Process(target=_bind, args=(folder, f"q{n}", barrier)) for n in range(6)]
        for binder in binders:
            binder.start()
        for binder in binders:
            binder.join(timeout=60)
            assert binder.exitcode == 0
        with Connection("filesystem://", transport_options=_options(folder)) as connection:
            table = connection.default_channel.get_table("shared")
        assert sorted(binding.queue for binding in table) == [f"q{n}" for n in range(6)]


def _consume(folder, queue: str, out) -> None:
    with Connection("filesystem://", transport_options=_options(folder)) as connection:
        simple = connection.SimpleQueue(queue)
        while True:
            try:
                message = simple.get(timeout=1.5)
            except simple.Empty:
                return
            out.put(message.payload["n"])
            message.ack()


def test_two_consumers_never_both_take_a_message(folder_connection, cpu_load):
    connection, folder = folder_connection
    queue = connection.SimpleQueue("shared-work")
    for n in range(600):
        queue.put({"n": n})
    context = PROCESSES
    out = context.Queue()
    consumers = [context.Process(target=_consume, args=(folder, "shared-work", out)) for _ in range(2)]
    for consumer in consumers:
        consumer.start()
    received = [out.get(timeout=60) for _ in range(600)]
    for consumer in consumers:
        consumer.join(timeout=60)
        assert consumer.exitcode == 0
    assert sorted(received) == list(range(600))
    assert out.empty()
    assert not list(folder.glob("*.msg")) and not list((folder / "processed").iterdir())
