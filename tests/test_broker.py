"""The embedded default's broker publishes message files atomically: a
consumer never takes a message that is still being written."""

import threading

import pytest
from kombu import Connection

from execgo.broker import Transport
from execgo.celery import app


@pytest.fixture
def folder_connection(tmp_path):
    options = {"data_folder_in": str(tmp_path), "data_folder_out": str(tmp_path), "polling_interval": 0.001,
               "control_folder": str(tmp_path / "control"), "processed_folder": str(tmp_path / "processed")}
    (tmp_path / "control").mkdir()
    (tmp_path / "processed").mkdir()
    with Connection("filesystem://", transport_options=options) as connection:
        yield connection, tmp_path


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


def test_a_busy_producer_and_consumer_lose_nothing(folder_connection):
    connection, _ = folder_connection
    sent = 2000

    def produce():
        with connection.clone() as producer_connection:
            queue = producer_connection.SimpleQueue("flood")
            for n in range(sent):
                queue.put({"n": n})

    producer = threading.Thread(target=produce)
    producer.start()
    received = []
    queue = connection.SimpleQueue("flood")
    while len(received) < sent:
        message = queue.get(timeout=30)
        received.append(message.payload["n"])
        message.ack()
    producer.join()
    assert sorted(received) == list(range(sent))
