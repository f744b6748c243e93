"""An http step runs in a process forked for it (runtime/tool_process.py),
which everyone else treats as a shim: launched once per handle, handed off,
waited for on its pidfd, cancelled by the cancel file or SIGTERM."""

import http.server
import json
import os
import signal
import threading
import time

import psutil
import pytest

from runtime import attach, executor, layout, shim, tool_process
from runtime.envelopes import EnvelopeError
from runtime.launcher import prepare_request
from tests.runtime.conftest import make_plan


class Held:
    """A loopback server holding each answer until ``release`` is set,
    noting requests whose client went away."""

    def __init__(self):
        self.release, self.arrived, self.dropped = threading.Event(), threading.Event(), threading.Event()
        held = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                held.arrived.set()
                give_up = time.monotonic() + 30
                while not held.release.wait(0.05) and time.monotonic() < give_up:
                    self.connection.settimeout(0)
                    try:
                        if self.connection.recv(1) == b"":
                            held.dropped.set()
                            return
                    except BlockingIOError:
                        pass
                    finally:
                        self.connection.settimeout(None)
                self.send_response(200)
                self.send_header("Content-Length", "4")
                self.end_headers()
                self.wfile.write(b"done")

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/held"


@pytest.fixture
def held(settings):
    settings.EXECGO_HTTP_ALLOWED_NETWORKS = ["127.0.0.1/32"]
    server = Held()
    yield server
    server.release.set()
    server.httpd.shutdown()
    server.httpd.server_close()


def start(handle: str, url: str, handed: list) -> None:
    """Run the step until it is handed off (at once), as a pool process does."""
    result = executor.execute(handle, tool="http", params={"url": url}, timeout_s=20, attempt=1, plan=make_plan(),
                              hand_off=lambda info, offset: handed.append(info) or True, hand_off_after_s=0.0)
    assert result is None  # handed off: this process waits no more


def launched(handle: str) -> dict:
    return json.loads((layout.task_dir(handle) / layout.LAUNCH_FILE).read_text())


def test_a_handed_off_http_step_ends_on_its_own_and_leaves_its_result(held, handle):
    handed = []
    start(handle, held.url, handed)
    info = launched(handle)
    assert info["via"] == "fork"
    assert handed == [{"pid": info["pid"], "create_time": info["create_time"]}]  # what the watcher waits on
    assert held.arrived.wait(10)
    assert attach.shim_alive(handle) and attach.read_result(handle) is None
    assert psutil.Process(info["pid"]).ppid() == os.getpid()  # until it ends, this process's child
    assert os.getsid(info["pid"]) == info["pid"]  # a session of its own: the worker's Ctrl-C is not its

    held.release.set()
    result = attach.wait(handle)  # as the watcher does: wakes on the pidfd, reads result.json
    assert result["status"] == "success" and result["output"] == {"status_code": 200, "body": "done"}
    assert not attach.shim_alive(handle)


def test_an_http_step_is_launched_once_per_handle(held, handle):
    held.release.set()
    directory, request = prepare_request(handle, tool="http", params={"url": held.url}, timeout_s=5, attempt=1,
                                         plan=make_plan())
    tool_process.launch(handle, tool="http", attempt=1, run=lambda: {"status": "success"})
    with pytest.raises(EnvelopeError) as refused:
        tool_process.launch(handle, tool="http", attempt=1, run=lambda: {"status": "success"})
    assert refused.value.envelope["code"] == "invalid_input"
    assert attach.wait(handle) == {"status": "success"}


def test_sigterm_cancels_the_step_and_drops_its_request(held, handle):
    start(handle, held.url, [])
    assert held.arrived.wait(10)
    attach.cancel(handle)  # the cancel file, then SIGTERM
    result = attach.wait(handle)
    assert result["status"] == "cancelled" and result["error"]["code"] == "cancelled"
    assert held.dropped.wait(10)  # the hop's helper went with it


def test_a_cancel_file_written_before_the_start_ends_it_unstarted(held, handle):
    prepare_request(handle, tool="http", params={"url": held.url}, timeout_s=5, attempt=1, plan=make_plan())
    (layout.task_dir(handle) / shim.CANCEL_FILE).touch()
    tool_process.launch(handle, tool="http", attempt=1, run=lambda: pytest.fail("ran despite the cancel"))
    result = attach.wait(handle)
    assert result["status"] == "cancelled"
    assert not held.arrived.is_set()


def test_a_step_process_that_dies_without_a_result_fails_the_step(held, handle):
    start(handle, held.url, [])
    assert held.arrived.wait(10)
    os.kill(launched(handle)["pid"], signal.SIGKILL)
    result = attach.wait(handle)
    assert result["status"] == "failed" and result["error"]["code"] == "internal"
