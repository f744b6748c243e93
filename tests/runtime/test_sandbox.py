"""The linux_sandbox profile: read-only host, no network, sandbox uid."""

import os
import socket
import threading
import uuid

import pytest
from django.conf import settings

from runtime import attach, layout
from runtime.envelopes import EnvelopeError
from runtime.plan_resolver import resolve_plan
from tests.runtime.conftest import SYSTEM_PYTHON, needs_bubblewrap, needs_system_python

pytestmark = needs_bubblewrap()


def test_writes_outside_the_workspace_fail(run_shell, handle):
    outside = f"/usr/local/execgo-outside-{uuid.uuid4().hex}"
    result = run_shell({"script": f"echo inside > ok.txt && echo x > {outside}; echo rc=$?"}, profile="linux_sandbox")
    assert result["output"]["stdout"] == "rc=2\n"  # dash: a failed redirection
    assert "Read-only file system" in result["details"]["stderr"]
    assert not os.path.exists(outside)
    # The workspace is the step's own tmpfs: nothing of it lands on the host's disk.
    assert not (layout.task_dir(handle) / "workspace" / "ok.txt").exists()


def test_the_task_directory_is_out_of_reach(run_shell, handle):
    # Only the workspace is mounted: ../ is a read-only skeleton, not the
    # directory holding request.json, the logs and result.json.
    result = run_shell(
        {"script": "ls ..; echo forged > ../result.json; echo x > ../escape.txt; true"}, profile="linux_sandbox"
    )
    assert result["status"] == "success"
    assert result["output"]["stdout"] == "workspace\n"
    assert not (layout.task_dir(handle) / "escape.txt").exists()
    assert attach.read_result(handle)["status"] == "success"


def test_private_tmp_is_not_the_hosts(run_shell):
    name = f"execgo-sandbox-{uuid.uuid4().hex}"
    result = run_shell({"script": f"echo x > /tmp/{name} && cat /tmp/{name}"}, profile="linux_sandbox")
    assert result["status"] == "success"
    assert not os.path.exists(f"/tmp/{name}")


@needs_system_python()
def test_no_network_not_even_host_loopback(run_shell, handle):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    connect = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3); print('connected')"
    try:
        sandboxed = run_shell({"argv": [SYSTEM_PYTHON, "-c", connect]}, profile="linux_sandbox")
        assert sandboxed["status"] == "failed"
        assert "connected" not in sandboxed["output"]["stdout"]
        assert (
            "ConnectionRefusedError" in sandboxed["details"]["stderr"]
            or "unreachable" in sandboxed["details"]["stderr"]
        )
        # The same command on the host network does reach it: the test can fail.
        plain = run_shell({"argv": [SYSTEM_PYTHON, "-c", connect]}, handle_id=f"{handle}-plain",
                          profile="linux_sandbox", network="host")
        assert plain["output"]["stdout"] == "connected\n"
    finally:
        server.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="a non-root worker keeps its own uid")
def test_runs_as_the_sandbox_uid_without_capabilities(run_shell):
    result = run_shell({"script": "id -u; grep CapEff /proc/self/status"}, profile="linux_sandbox")
    uid, caps = result["output"]["stdout"].splitlines()
    assert int(uid) == result["details"]["plan"]["uid"] >= settings.EXECGO_SANDBOX_UID
    assert caps.split()[1] == "0000000000000000"


def test_strict_without_bubblewrap_refuses_before_running(manifest, handle):
    no_bwrap = {**manifest, "bubblewrap": {"available": False, "path": None, "error": "bwrap not installed"}}
    with pytest.raises(EnvelopeError) as refused:
        resolve_plan({"profile": "linux_sandbox"}, mode="strict", manifest=no_bwrap)
    assert refused.value.envelope["code"] == "denied"
    assert "bubblewrap" in refused.value.envelope["message"]
    assert not layout.task_dir(handle).exists()


def test_adaptive_without_bubblewrap_downgrades_and_says_so(manifest, run_shell):
    no_bwrap = {**manifest, "bubblewrap": {"available": False, "path": None, "error": "bwrap not installed"}}
    plan = resolve_plan({"profile": "linux_sandbox"}, mode="adaptive", manifest=no_bwrap)
    assert plan["profile"] == "process"
    # A root worker contains the process profile with namespaces of its own.
    assert plan["network"] == ("none" if manifest["namespaces"]["mount"] else "host")
    assert plan["downgrades"][:1] == [
        {
            "what": "profile",
            "requested": "linux_sandbox",
            "effective": "process",
            "reason": "bubblewrap unusable on this host: bwrap not installed",
        }
    ]


def test_the_data_directory_is_hidden(run_shell, tmp_path):
    # The embedded database and every other step's files live there.
    secret = settings.DATA_DIR / f"secret-{uuid.uuid4().hex}"
    secret.write_text("other tenants' data")
    secret.chmod(0o644)
    try:
        result = run_shell({"script": f"ls -a {settings.DATA_DIR}; cat {secret} 2>&1; echo end"},
                           profile="linux_sandbox")
    finally:
        secret.unlink()
    listing = result["output"]["stdout"].split("\n")
    assert secret.name not in listing
    assert "tasks" in listing  # only the skeleton down to the workspace
    assert "No such file" in result["output"]["stdout"]
    assert "other tenants" not in result["output"]["stdout"]
