"""The network an http step's request is sent from: a namespace of its own
behind pasta, where the host's loopback is out of reach whatever address
the request's process is handed; the host's network for an allow-listed
internal destination only; strict refuses and adaptive records the
downgrade where pasta is missing.

The guard is stepped around on purpose here (the launch function below it,
or a guard that passes the canary's address as a public one): what is
tested is the wall behind it, for a helper taken over by a response. Only
loopback is ever connected to."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import threading
import time

import psutil
import pytest
from django.conf import settings as django_settings

from runtime import egress, executor
from runtime.tools import http_process
from tests.runtime.conftest import make_plan, needs_bubblewrap
from tests.runtime.test_egress import Recording

PROFILES = ["process", pytest.param("linux_sandbox", marks=needs_bubblewrap())]


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(b"canary reached")


@pytest.fixture(scope="module")
def canaries():
    """The host's loopback services, as a taken-over helper would look for them."""
    servers = {"127.0.0.1": Recording(("127.0.0.1", 0), Handler, socket.AF_INET),
               "::1": Recording(("::1", 0), Handler, socket.AF_INET6)}
    for server in servers.values():
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield servers
    for server in servers.values():
        server.shutdown()


@pytest.fixture(autouse=True)
def quiet(canaries):
    for server in canaries.values():
        server.connections.clear()


@pytest.fixture
def workspace(tmp_path):
    path = tmp_path / "workspace"
    path.mkdir()
    os.chmod(path, 0o777)
    return path


def spec_for(address: str, port: int) -> dict:
    return {"address": address, "port": port, "family": socket.AF_INET6 if ":" in address else socket.AF_INET,
            "scheme": "http", "host": "public.test", "method": "GET", "target": "/", "headers": {},
            "body_b64": None, "timeout_s": 3, "max_body_bytes": 1024, "ca_certificates": None}


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("address", ["127.0.0.1", "::1"])
def test_a_helper_behind_pasta_cannot_reach_the_hosts_loopback_even_when_handed_its_address(
        canaries, workspace, tmp_path, profile, address):
    server = canaries[address]
    plan = make_plan(profile)
    reply = http_process.call_helper(spec_for(address, server.server_address[1]), plan=plan, workspace=workspace,
                                  directory=tmp_path, timeout=3, network="pasta")
    assert reply.get("error") == "failed", reply
    assert "ConnectionRefusedError" in reply["message"] or "Errno" in reply["message"], reply
    assert server.connections == []
    # The same call from the host's network (what an allow-listed destination gets) reaches it.
    reply = http_process.call_helper(spec_for(address, server.server_address[1]), plan=plan, workspace=workspace,
                                  directory=tmp_path, timeout=3, network="host")
    assert reply.get("status") == 200, reply
    assert len(server.connections) == 1


def helper_process(launched: psutil.Process, deadline_s: float = 10) -> psutil.Process:
    """The helper's interpreter among ``launched`` and its descendants (pasta and
    bubblewrap come first)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for process in [launched, *launched.children(recursive=True)]:
            try:
                argv = process.cmdline()
            except psutil.Error:
                continue
            if argv[:3] == [django_settings.EXECGO_HTTP_HELPER_PYTHON, "-I", "-S"]:
                return process
        time.sleep(0.01)
    raise AssertionError("the helper's interpreter never started")


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("network", ["pasta", "host"])
def test_the_helper_behind_pasta_is_in_a_network_namespace_of_its_own(
        canaries, workspace, tmp_path, profile, network):
    server = canaries["127.0.0.1"]
    plan = make_plan(profile)
    with open(tmp_path / "reply.json", "wb") as out:
        process = http_process.start_helper(plan, workspace, network=network, stdin=subprocess.PIPE, stdout=out)
        try:
            helper = helper_process(psutil.Process(process.pid))  # it waits for its request on stdin
            helper_namespace = os.readlink(f"/proc/{helper.pid}/ns/net")
            spec = {**spec_for("127.0.0.1", server.server_address[1]),
                    "limits": {"address_space_bytes": 1 << 30, "cpu_seconds": 5, "output_bytes": 1 << 20}}
            process.communicate(json.dumps(spec).encode(), timeout=15)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, 9)
                process.wait()
    reply = json.loads((tmp_path / "reply.json").read_bytes())
    worker_namespace = os.readlink("/proc/self/ns/net")
    if network == "pasta":
        assert helper_namespace != worker_namespace
        assert reply["error"] == "failed" and server.connections == []
    else:
        assert helper_namespace == worker_namespace
        assert reply["status"] == 200 and len(server.connections) == 1


def a_guard_that_passes(address):
    """A guard that took the canary's address for a public one."""
    return lambda host, port, **details: egress.Destination(host=host, address=address, port=port)


@pytest.mark.parametrize("profile", PROFILES)
def test_a_step_the_guard_wrongly_passed_still_cannot_reach_the_hosts_loopback(
        canaries, handle, profile, monkeypatch):
    server = canaries["127.0.0.1"]
    monkeypatch.setattr(egress, "check_destination", a_guard_that_passes("127.0.0.1"))
    result = executor.execute(handle, tool="http", params={"url": f"http://public.test:{server.server_address[1]}/"},
                              timeout_s=5, attempt=1, plan=make_plan(profile))
    assert result["status"] == "failed"
    assert result["error"]["code"] == "external_failure" and result["error"]["retryable"] is True
    assert result["details"]["request_network"] == "pasta"
    assert "downgrades" not in result["details"]
    assert server.connections == []


@pytest.mark.parametrize("profile", PROFILES)
def test_an_allow_listed_internal_destination_gets_the_hosts_network(canaries, handle, profile, settings):
    settings.EXECGO_HTTP_ALLOWED_NETWORKS = ["::1/128"]
    server = canaries["::1"]
    result = executor.execute(handle, tool="http", params={"url": f"http://[::1]:{server.server_address[1]}/"},
                              timeout_s=5, attempt=1, plan=make_plan(profile))
    assert result["status"] == "success", result["error"]
    assert result["output"] == {"status_code": 200, "body": "canary reached"}
    assert result["details"]["request_network"] == "host"
    assert len(server.connections) == 1


def test_a_public_destination_is_sent_from_pasta_and_an_internal_one_needs_the_list(settings):
    plan = make_plan("process")
    public = egress.check_destination("8.8.8.8", 443, timeout_s=1)  # checked only: nothing is sent
    assert http_process.helper_network(public, plan) == ("pasta", None)
    settings.EXECGO_HTTP_ALLOWED_NETWORKS = ["127.0.0.0/8"]
    listed = egress.check_destination("127.0.0.9", 80, timeout_s=1)
    assert http_process.helper_network(listed, plan) == ("host", None)


@pytest.mark.parametrize("profile", PROFILES)
def test_without_pasta_strict_refuses_before_the_request_starts(canaries, handle, profile, settings, monkeypatch):
    settings.EXECGO_PASTA_PATH = "/nonexistent/pasta"
    server = canaries["127.0.0.1"]
    monkeypatch.setattr(egress, "check_destination", a_guard_that_passes("127.0.0.1"))
    started = []
    monkeypatch.setattr(http_process, "start_helper", lambda *args, **kwargs: started.append(args))
    plan = make_plan(profile)
    assert plan["mode"] == "strict"
    result = executor.execute(handle, tool="http", params={"url": f"http://public.test:{server.server_address[1]}/"},
                              timeout_s=5, attempt=1, plan=plan)
    assert result["status"] == "failed"
    assert result["error"]["code"] == "denied"
    assert result["error"]["message"] == ("cannot send the request from a network namespace of its own: "
                                          "pasta (passt) is not installed")
    assert result["error"]["details"]["what"] == "request_network"
    assert started == [] and server.connections == []


@pytest.mark.parametrize("profile", PROFILES)
def test_without_pasta_adaptive_sends_from_the_hosts_network_and_says_so(canaries, handle, profile, settings,
                                                                         monkeypatch):
    settings.EXECGO_PASTA_PATH = "/nonexistent/pasta"
    server = canaries["127.0.0.1"]
    monkeypatch.setattr(egress, "check_destination", a_guard_that_passes("127.0.0.1"))
    plan = {**make_plan(profile), "mode": "adaptive"}
    result = executor.execute(handle, tool="http", params={"url": f"http://public.test:{server.server_address[1]}/"},
                              timeout_s=5, attempt=1, plan=plan)
    # Weaker, as recorded: the host's loopback is in reach again.
    assert result["status"] == "success", result["error"]
    assert result["details"]["request_network"] == "host"
    assert result["details"]["downgrades"] == [{"what": "request_network", "requested": "pasta", "effective": "host",
                                                "reason": "pasta (passt) is not installed"}]
    assert len(server.connections) == 1


def test_the_wait_for_the_helper_ends_with_it_or_at_its_deadline():
    quick = subprocess.Popen(["/bin/true"])
    assert http_process._wait(quick, 5) is True and quick.returncode == 0
    slow = subprocess.Popen(["/bin/sleep", "30"])
    try:
        started = time.monotonic()
        assert http_process._wait(slow, 0.2) is False
        assert time.monotonic() - started < 10 and slow.poll() is None
    finally:
        slow.kill()
        slow.wait()


def _status_fields(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.rstrip("\n").split(":\t", 1) for line in status if ":\t" in line)
    return {name: fields[name].strip() for name in ("Seccomp", "NoNewPrivs")}


@needs_bubblewrap()
@pytest.mark.parametrize("with_filter", [True, False])
def test_a_sandboxed_helper_runs_under_the_shell_steps_system_call_filter(workspace, tmp_path, with_filter):
    plan = {**make_plan("linux_sandbox"), "seccomp": with_filter}
    with open(tmp_path / "reply.json", "wb") as out:
        process = http_process.start_helper(plan, workspace, network="host", stdin=subprocess.PIPE, stdout=out)
        try:
            fields = _status_fields(helper_process(psutil.Process(process.pid)).pid)
        finally:
            os.killpg(process.pid, 9)
            process.wait()
    # 2: a filter is loaded (bubblewrap's --seccomp); bubblewrap always sets no_new_privs.
    assert fields == {"Seccomp": "2" if with_filter else "0", "NoNewPrivs": "1"}
