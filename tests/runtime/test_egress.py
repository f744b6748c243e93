"""The egress guard of http steps: every spelling and route to a loopback
canary gets nothing, the canary records no connection; an allow-listed
server is reached, from a process that is not the worker's.

Only loopback is ever connected to: internal addresses elsewhere (10/8,
169.254.169.254, …) are only checked (``check_destination`` does not
connect) and rated (tests/runs/test_policy_egress.py)."""

from __future__ import annotations

import http.server
import os
import socket
import threading

import psutil
import pytest

from runtime import egress, executor
from runtime.envelopes import EnvelopeError
from tests.runtime.conftest import make_plan


class Recording(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, handler, family=socket.AF_INET):
        self.address_family = family
        self.connections: list[tuple] = []
        self.seen: list[dict] = []
        super().__init__(address, handler)

    def verify_request(self, request, client_address):
        self.connections.append(client_address)
        return True


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", self.path.split("to=", 1)[1])
            self.end_headers()
            return
        # Who is connected to us, while the client still waits for the answer.
        peer = self.client_address
        pid = next((c.pid for c in psutil.net_connections(kind="tcp")
                    if c.laddr and (c.laddr.ip, c.laddr.port) == peer[:2] and c.pid), None)
        environ = b""
        if pid is not None:
            try:
                environ = open(f"/proc/{pid}/environ", "rb").read()
            except OSError:
                environ = b"<unreadable>"
        self.server.seen.append({"pid": pid, "environ": environ, "host": self.headers["Host"],
                                 "uid": psutil.Process(pid).uids().real if pid else None})
        body = f"hello from {self.server.server_address[0]}".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(body)


def serve(host: str, family=socket.AF_INET):
    server = Recording((host, 0), Handler, family)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def canaries():
    """Servers nothing may reach: 127.0.0.1, another 127/8 address, ::1."""
    servers = {"v4": serve("127.0.0.1"), "other": serve("127.5.5.5"), "v6": serve("::1", socket.AF_INET6)}
    yield servers
    for server in servers.values():
        server.shutdown()


@pytest.fixture(scope="module")
def allowed_server():
    server = serve("127.0.0.2")
    yield server
    server.shutdown()


@pytest.fixture(autouse=True)
def clean(canaries, allowed_server, settings):
    settings.EXECGO_HTTP_ALLOWED_NETWORKS = ["127.0.0.2/32"]
    for server in (*canaries.values(), allowed_server):
        server.connections.clear()
        server.seen.clear()
    yield
    assert not any(server.connections for server in canaries.values()), "a canary was reached"


def call(handle, params, profile="process"):
    return executor.execute(handle, tool="http", params=params, timeout_s=5, attempt=1, plan=make_plan(profile))


def spellings(canaries):
    p4, p6 = canaries["v4"].server_address[1], canaries["v6"].server_address[1]
    other = canaries["other"].server_address[1]
    return [
        (f"http://127.0.0.1:{p4}/", "127.0.0.1", "loopback"),
        (f"http://127.1:{p4}/", "127.0.0.1", "loopback"),
        (f"http://2130706433:{p4}/", "127.0.0.1", "loopback"),
        (f"http://0x7f000001:{p4}/", "127.0.0.1", "loopback"),
        (f"http://0x7f.0.0.1:{p4}/", "127.0.0.1", "loopback"),
        (f"http://0177.0.0.1:{p4}/", "127.0.0.1", "loopback"),
        (f"http://0.0.0.0:{p4}/", "0.0.0.0", "unspecified"),
        (f"http://0:{p4}/", "0.0.0.0", "unspecified"),
        (f"http://[::1]:{p6}/", "::1", "loopback"),
        (f"http://[0:0:0:0:0:0:0:1]:{p6}/", "::1", "loopback"),
        (f"http://[::]:{p6}/", "::", "unspecified"),
        (f"http://[::ffff:127.0.0.1]:{p4}/", "::ffff:7f00:1", "IPv4-mapped (embeds 127.0.0.1, loopback)"),
        (f"http://[::127.0.0.1]:{p4}/", "::7f00:1", "IPv4-compatible (embeds 127.0.0.1, loopback)"),
        (f"http://localhost:{p4}/", "127.0.0.1", "loopback"),
        (f"http://LOCALHOST.:{p4}/", "127.0.0.1", "loopback"),
        (f"http://canary.localhost:{p4}/", "127.0.0.1", "loopback"),
        (f"http://127.5.5.5:{other}/", "127.5.5.5", "loopback"),
        (f"http://127.255.255.254:{p4}/", "127.255.255.254", "loopback"),
        (f"https://127.0.0.1:{p4}/", "127.0.0.1", "loopback"),
    ]


def test_every_spelling_of_the_loopback_is_denied_and_the_canary_sees_nothing(canaries, handle):
    cases = spellings(canaries)
    assert len(cases) >= 15
    for index, (url, address, kind) in enumerate(cases):
        result = call(f"{handle}-{index}", {"url": url})
        assert result["status"] == "failed", url
        error = result["error"]
        assert error["code"] == "denied", (url, error)
        assert error["details"]["address"] == address and error["details"]["class"] == kind, (url, error)
        assert error["message"].startswith(f"destination {address} is a"), error["message"]
    assert error["message"] == "destination 127.0.0.1 is a loopback address"


def test_names_that_resolve_to_loopback_are_denied(canaries, handle, monkeypatch):
    port = canaries["v4"].server_address[1]
    answers = {"internal.test": ["127.0.0.1"], "six.test": ["::1"], "mixed.test": ["127.0.0.2", "127.0.0.1"]}
    monkeypatch.setattr(egress, "resolve_name", lambda host, port: answers[host])
    for index, name in enumerate(answers):
        result = call(f"{handle}-{index}", {"url": f"http://{name}:{port}/"})
        assert result["error"]["code"] == "denied", result["error"]
        assert result["error"]["details"]["class"] == "loopback"
        assert f"({name} resolves to it)" in result["error"]["message"]


@pytest.mark.parametrize("profile", ["process", "linux_sandbox"])
def test_an_allow_listed_host_is_reached_from_a_process_that_is_not_the_worker(
        allowed_server, handle, profile, monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgres://secret@127.0.0.1/never")
    port = allowed_server.server_address[1]
    plan = make_plan(profile)
    result = executor.execute(handle, tool="http", params={"url": f"http://127.0.0.2:{port}/x"}, timeout_s=5,
                              attempt=1, plan=plan)
    assert result["status"] == "success", result["error"]
    assert result["output"] == {"status_code": 200, "body": "hello from 127.0.0.2"}
    assert result["details"]["address"] == "127.0.0.2"
    [seen] = allowed_server.seen
    assert seen["pid"] is not None and seen["pid"] != os.getpid()
    assert b"DATABASE_URL" not in seen["environ"] and b"secret" not in seen["environ"]
    assert seen["environ"] and seen["environ"] != b"<unreadable>"
    if plan.get("uid") is not None:
        assert seen["uid"] == plan["uid"]


def test_redirects_are_not_followed_by_default(canaries, allowed_server, handle):
    port, canary = allowed_server.server_address[1], canaries["v4"].server_address[1]
    result = call(handle, {"url": f"http://127.0.0.2:{port}/redirect?to=http://127.0.0.1:{canary}/"})
    assert result["status"] == "success"
    assert result["output"]["status_code"] == 302
    assert result["details"]["headers"]["Location"] == f"http://127.0.0.1:{canary}/"


@pytest.mark.parametrize("target", ["http://127.0.0.1:{canary}/", "http://localhost:{canary}/",
                                    "http://2130706433:{canary}/", "http://[::1]:{canary6}/"])
def test_a_followed_redirect_to_the_canary_is_denied(canaries, allowed_server, handle, target):
    port = allowed_server.server_address[1]
    target = target.format(canary=canaries["v4"].server_address[1], canary6=canaries["v6"].server_address[1])
    result = call(handle, {"url": f"http://127.0.0.2:{port}/redirect?to={target}", "follow_redirects": 3})
    assert result["error"]["code"] == "denied", result["error"]
    assert result["error"]["details"]["hop"] == 1 and result["error"]["details"]["url"] == target
    assert len(allowed_server.connections) == 1


def test_a_redirect_between_allowed_urls_is_followed_and_bounded(allowed_server, handle):
    port = allowed_server.server_address[1]
    final = f"http://127.0.0.2:{port}/final"
    result = call(handle, {"url": f"http://127.0.0.2:{port}/redirect?to={final}", "follow_redirects": 1})
    assert result["output"] == {"status_code": 200, "body": "hello from 127.0.0.2"}
    assert result["details"]["redirects"] == [{"status_code": 302, "location": final}]
    chain = f"http://127.0.0.2:{port}/redirect?to=http://127.0.0.2:{port}/redirect?to={final}"
    stopped = call(f"{handle}-2", {"url": chain, "follow_redirects": 1})
    assert stopped["output"]["status_code"] == 302  # the second hop would be one too many


@pytest.mark.parametrize("value", [-1, 6, 1.5, True, "2"])
def test_follow_redirects_is_bounded(handle, value):
    result = call(handle, {"url": "http://127.0.0.2/", "follow_redirects": value})
    assert result["error"]["code"] == "invalid_input"


def test_a_dns_answer_that_changes_after_the_check_changes_nothing(canaries, allowed_server, handle, monkeypatch,
                                                                     tmp_path):
    """Rebinding: the first answer is the allowed server, every later one the
    canary. The name is resolved once, and the request goes to what was checked."""
    port = allowed_server.server_address[1]
    # Written down in a file: the step runs in a process of its own (runtime/tool_process.py).
    lookups = tmp_path / "lookups"
    lookups.touch()

    def rebinding(host, port):
        first = not lookups.read_text()
        with open(lookups, "a") as fh:
            fh.write(host + "\n")
        return ["127.0.0.2"] if first else ["127.0.0.1"]

    monkeypatch.setattr(egress, "resolve_name", rebinding)
    result = call(handle, {"url": f"http://rebind.test:{port}/"})
    assert result["output"] == {"status_code": 200, "body": "hello from 127.0.0.2"}, result["error"]
    assert lookups.read_text().splitlines() == ["rebind.test"]
    assert allowed_server.seen[0]["host"] == f"rebind.test:{port}"  # the name, not the address, as Host


@pytest.mark.parametrize("host,kind", [
    ("169.254.169.254", "cloud metadata"), ("fd00:ec2::254", "cloud metadata"),
    ("100.100.100.200", "cloud metadata"), ("10.0.0.1", "private (RFC 1918)"),
    ("172.16.5.4", "private (RFC 1918)"), ("192.168.1.1", "private (RFC 1918)"),
    ("100.64.0.1", "shared CGNAT"), ("169.254.1.1", "link-local"), ("fe80::1", "link-local"),
    ("fc00::1", "private (unique local)"), ("fec0::1", "private (site-local)"), ("224.0.0.1", "multicast"),
    ("255.255.255.255", "broadcast"), ("240.0.0.1", "reserved"), ("192.0.2.1", "documentation"),
    ("2001:db8::1", "documentation"), ("198.18.0.1", "benchmarking"), ("64:ff9b::a00:1", "NAT64"),
    ("64:ff9b:1::1", "NAT64 (local use)"), ("2002:a9fe:a9fe::1", "6to4 (embeds 169.254.169.254"),
    ("2001:0:4136:e378:8000:63bf:80ff:fffe", "Teredo (embeds 127.0.0.1"), ("::ffff:10.0.0.1", "IPv4-mapped"),
    ("0251.0376.0251.0376", "cloud metadata"), ("2852039166", "cloud metadata"),
])
def test_internal_addresses_are_refused_before_any_connect(host, kind, monkeypatch):
    def no_connect(*args, **kwargs):
        raise AssertionError("the guard connected")

    monkeypatch.setattr(socket.socket, "connect", no_connect)
    with pytest.raises(EnvelopeError) as caught:
        egress.check_destination(host, 80, timeout_s=1)
    assert caught.value.code == "denied"
    assert caught.value.envelope["details"]["class"].startswith(kind)


def test_public_addresses_pass_the_check():
    for host in ("8.8.8.8", "2606:4700::1111", "2002:808:808::1"):
        assert egress.check_destination(host, 443, timeout_s=1).address in (host, "2002:808:808::1")


def test_a_metadata_address_needs_an_exact_allow_list_entry(settings):
    settings.EXECGO_HTTP_ALLOWED_NETWORKS = ["169.254.0.0/16"]
    with pytest.raises(EnvelopeError):
        egress.check_destination("169.254.169.254", 80, timeout_s=1)
    assert egress.check_destination("169.254.1.1", 80, timeout_s=1).allow_listed
    settings.EXECGO_HTTP_ALLOWED_NETWORKS = ["169.254.169.254/32"]
    assert egress.check_destination("169.254.169.254", 80, timeout_s=1).allow_listed


def test_a_bad_allow_list_entry_is_a_configuration_error(settings):
    from django.core.exceptions import ImproperlyConfigured

    settings.EXECGO_HTTP_ALLOWED_NETWORKS = ["not-a-network"]
    with pytest.raises(ImproperlyConfigured):
        egress.check_destination("10.0.0.1", 80, timeout_s=1)
