"""The http tool, against a server on this machine."""

import http.server
import json
import threading
import time

import pytest

from runtime import attach, executor
from tests.conftest import free_port
from tests.runtime.conftest import make_plan


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path == "/slow":
            time.sleep(2)
        if self.path == "/big":
            body = b"x" * 5000
        elif self.path == "/missing":
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b"nope")
            return
        elif self.path == "/busy":
            self.send_response(503)
            self.end_headers()
            return
        else:
            body = b"hello"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("X-Test", "yes")
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        length = int(self.headers["Content-Length"])
        payload = json.loads(self.rfile.read(length))
        body = json.dumps({"got": payload, "type": self.headers["Content-Type"]}).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(autouse=True)
def loopback_allowed(settings):
    # The test server is on the host's loopback, which the egress guard refuses unless listed.
    settings.EXECGO_HTTP_ALLOWED_NETWORKS = ["127.0.0.1/32"]


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def call(handle, params, timeout_s=5):
    return executor.execute(handle, tool="http", params=params, timeout_s=timeout_s, attempt=1, plan=make_plan())


def test_get(server, handle):
    result = call(handle, {"method": "GET", "url": f"{server}/"})
    assert result["status"] == "success", result["error"]
    assert result["output"] == {"status_code": 200, "body": "hello"}
    assert result["details"]["headers"]["X-Test"] == "yes"
    assert attach.read_result(handle) == result


def test_post_json(server, handle):
    result = call(handle, {"method": "POST", "url": f"{server}/", "body": {"a": 1}})
    assert result["output"]["status_code"] == 201
    assert json.loads(result["output"]["body"]) == {"got": {"a": 1}, "type": "application/json"}


def test_body_is_capped(server, handle, settings):
    settings.EXECGO_HTTP_MAX_BODY_BYTES = 1000
    result = call(handle, {"url": f"{server}/big"})
    assert len(result["output"]["body"]) == 1000
    assert result["details"]["body_truncated"] is True


def test_404_is_failed_not_retryable_with_the_response(server, handle):
    result = call(handle, {"url": f"{server}/missing"})
    assert result["status"] == "failed"
    assert result["output"] == {"status_code": 404, "body": "nope"}
    assert result["error"]["code"] == "external_failure"
    assert result["error"]["retryable"] is False


def test_503_is_retryable(server, handle):
    result = call(handle, {"url": f"{server}/busy"})
    assert result["error"]["retryable"] is True


def test_timeout(server, handle):
    result = call(handle, {"url": f"{server}/slow", "timeout_s": 0.3})
    assert result["error"]["code"] == "timeout"
    assert result["error"]["retryable"] is True


def test_connection_refused_is_retryable_external_failure(handle):
    port = free_port()
    result = call(handle, {"url": f"http://127.0.0.1:{port}/"})
    assert result["error"]["code"] == "external_failure"
    assert result["error"]["retryable"] is True


@pytest.mark.parametrize(
    "params",
    [
        {"url": "file:///etc/passwd"},
        {"url": "ftp://example.org/"},
        {"url": "not a url"},
        {"method": "BREW", "url": "http://127.0.0.1/"},
        {"url": "http://127.0.0.1/", "headers": {"X": "a\r\nInjected: 1"}},
        {"url": "http://127.0.0.1/", "timeout_s": -1},
    ],
)
def test_bad_params_are_invalid_input(handle, params):
    result = call(handle, params)
    assert result["error"]["code"] == "invalid_input"
