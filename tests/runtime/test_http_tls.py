"""https steps: the request connects to the checked address and verifies the
certificate against the URL's host name (the TLS server name too), the
system's CAs plus those of ``EXECGO_HTTP_CA_BUNDLE``.

A TLS server on the loopback (allow-listed) with a CA and certificate
the test makes itself (trustme); names resolve through the guard's seam."""

from __future__ import annotations

import http.server
import json
import ssl
import threading

import pytest
import trustme

from runtime import egress, executor
from runtime.tools import http_process
from tests.runtime.conftest import make_plan, needs_bubblewrap

ADDRESS = "127.0.0.3"
PROFILES = ["process", pytest.param("linux_sandbox", marks=needs_bubblewrap())]


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.server.requests.append({"host": self.headers["Host"], "path": self.path})
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(b"over tls")


class TLSServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, context):
        self.requests: list[dict] = []
        self.server_names: list[str | None] = []
        context.sni_callback = lambda sock, name, ctx: self.server_names.append(name)
        super().__init__(address, Handler)
        self.socket = context.wrap_socket(self.socket, server_side=True)


@pytest.fixture(scope="module")
def ca():
    return trustme.CA()


@pytest.fixture(scope="module")
def server(ca):
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("tls.test").configure_cert(context)
    httpd = TLSServer((ADDRESS, 0), context)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()


@pytest.fixture(autouse=True)
def names(server, settings, monkeypatch):
    settings.EXECGO_HTTP_ALLOWED_NETWORKS = [f"{ADDRESS}/32"]
    answers = {"tls.test": [ADDRESS], "wrong.test": [ADDRESS]}
    monkeypatch.setattr(egress, "resolve_name", lambda host, port: answers[host])
    server.requests.clear()
    server.server_names.clear()


@pytest.fixture
def trusted(ca, settings, tmp_path):
    bundle = tmp_path / "extra-ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    settings.EXECGO_HTTP_CA_BUNDLE = str(bundle)


def call(handle, url, profile):
    return executor.execute(handle, tool="http", params={"url": url}, timeout_s=5, attempt=1,
                            plan=make_plan(profile))


@pytest.mark.parametrize("profile", PROFILES)
def test_the_right_name_with_the_ca_trusted_succeeds(server, trusted, handle, profile):
    port = server.server_address[1]
    result = call(handle, f"https://tls.test:{port}/hello", profile)
    assert result["status"] == "success", result["error"]
    assert result["output"] == {"status_code": 200, "body": "over tls"}
    assert result["details"]["address"] == ADDRESS
    assert server.server_names == ["tls.test"]  # the name, not the address, as the TLS server name
    assert server.requests == [{"host": f"tls.test:{port}", "path": "/hello"}]


@pytest.mark.parametrize("profile", PROFILES)
def test_a_name_the_certificate_is_not_for_fails_clearly(server, trusted, handle, profile):
    port = server.server_address[1]
    result = call(handle, f"https://wrong.test:{port}/", profile)
    assert result["status"] == "failed"
    error = result["error"]
    assert error["code"] == "external_failure" and error["retryable"] is False
    assert error["message"].startswith("http request failed: the certificate of wrong.test does not verify: ")
    assert "Hostname mismatch, certificate is not valid for 'wrong.test'" in error["message"], error["message"]
    assert error["details"]["host"] == "wrong.test"
    assert server.server_names == ["wrong.test"] and server.requests == []  # nothing was sent


@pytest.mark.parametrize("profile", PROFILES)
def test_a_ca_nobody_trusts_fails_clearly(server, handle, profile, settings):
    assert not settings.EXECGO_HTTP_CA_BUNDLE
    result = call(handle, f"https://tls.test:{server.server_address[1]}/", profile)
    error = result["error"]
    assert error["code"] == "external_failure" and error["retryable"] is False
    assert "does not verify: unable to get local issuer certificate" in error["message"], error["message"]
    assert server.requests == []


def test_an_address_literal_url_is_checked_against_the_certificate_too(server, trusted, handle):
    result = call(handle, f"https://{ADDRESS}:{server.server_address[1]}/", "process")
    assert result["error"]["code"] == "external_failure"
    assert f"certificate is not valid for '{ADDRESS}'" in result["error"]["message"], result["error"]["message"]
    assert server.requests == []


def test_a_bundle_that_cannot_be_read_is_an_error_before_any_connect(server, handle, settings, tmp_path):
    settings.EXECGO_HTTP_CA_BUNDLE = str(tmp_path / "missing.pem")
    result = call(handle, f"https://tls.test:{server.server_address[1]}/", "process")
    assert result["error"]["code"] == "internal"
    assert result["error"]["message"].startswith("cannot read EXECGO_HTTP_CA_BUNDLE: ")
    assert server.server_names == [] and server.requests == []


def test_the_bundle_goes_with_https_requests_only(server, trusted, handle, monkeypatch, tmp_path):
    # The step runs in a process of its own (runtime/tool_process.py): the spy writes down what it saw.
    notes = tmp_path / "seen.jsonl"
    real = http_process.call_helper

    def spy(spec, **kwargs):
        with open(notes, "a") as fh:
            fh.write(json.dumps(spec.get("ca_certificates")) + "\n")
        return real(spec, **kwargs)

    monkeypatch.setattr(http_process, "call_helper", spy)
    call(handle, f"https://tls.test:{server.server_address[1]}/", "process")
    call(f"{handle}-2", f"http://tls.test:{server.server_address[1]}/", "process")
    seen = [json.loads(line) for line in notes.read_text().splitlines()]
    assert seen[0].startswith("-----BEGIN CERTIFICATE-----") and seen[1] is None
