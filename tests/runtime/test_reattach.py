"""The shim outlives its parent; a new process re-attaches and reads the result."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from django.conf import settings

from runtime import attach, forkserver, launcher, layout, shim_process
from tests.runtime.conftest import live_processes, make_plan, wait_until

ROOT = Path(__file__).resolve().parents[2]

WORKER = textwrap.dedent(
    """
    import os, sys, time, django
    os.environ["DJANGO_SETTINGS_MODULE"] = "execgo.settings"
    django.setup()
    from django.conf import settings
    from runtime import attach, launcher, layout
    from runtime.plan_resolver import resolve_plan
    settings.EXECGO_SHIM_FORKSERVER = sys.argv[2] == "forkserver"
    handle = sys.argv[1]
    launcher.prepare(handle, tool="shell", params={"script": sys.argv[3]}, timeout_s=60, attempt=1,
                     plan=resolve_plan({"profile": "process"}))
    shim = launcher.launch(handle)
    print(shim.pid, shim.via, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("via", ["forkserver", "spawn"])
def test_shim_survives_sigkill_of_its_worker(handle, marker, via):
    script = f"sleep 1.{marker}; echo finished"
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, handle, via, script],
        cwd=ROOT,
        env={**os.environ, "EXECGO_DATA_DIR": str(settings.DATA_DIR), "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pid, used = worker.stdout.readline().split()
        assert used == via
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        if via == "forkserver":  # the server dying does not matter either
            server = forkserver.server_pid(str(layout.tasks_dir()))
            os.kill(server, signal.SIGKILL)
        assert attach.shim_alive(handle)
        result = attach.wait(handle)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert result["status"] == "success"
    assert result["output"]["stdout"] == "finished\n"
    assert attach.read_result(handle) == result
    assert not attach.shim_alive(handle)
    assert live_processes(marker) == []


def test_wait_reports_internal_when_the_shim_is_killed(handle, marker):
    plan = make_plan()
    launcher.prepare(
        handle, tool="shell", params={"argv": ["sleep", f"600.{marker}"]}, timeout_s=600, attempt=1, plan=plan
    )
    launcher.launch(handle)
    shim_file = layout.task_dir(handle) / "shim.json"
    assert wait_until(lambda: shim_file.exists() and live_processes(marker) != [])
    os.kill(json.loads(shim_file.read_text())["pid"], signal.SIGKILL)
    result = attach.wait(handle)
    assert result["status"] == "failed"
    assert result["error"]["code"] == "internal"
    assert "no result" in result["error"]["message"] or "without writing result.json" in result["error"]["message"]
    assert attach.read_result(handle) == result
    if plan["tree_kill"] == "pid_namespace":  # the kernel takes the command down with its PID 1
        assert wait_until(lambda: live_processes(marker) == [], 2)


def test_shim_alive_defeats_pid_reuse(handle):
    launcher.prepare(handle, tool="shell", params={"argv": ["true"]}, timeout_s=5, attempt=1, plan=make_plan())
    directory = layout.task_dir(handle)
    # Our own (live) pid, with a create time that is not ours: a reused pid.
    started = shim_process.process_create_time(os.getpid())  # seconds after boot
    (directory / "shim.json").write_text(json.dumps({"pid": os.getpid(), "create_time": started - 1.0}))
    assert not attach.shim_alive(handle)

    (directory / "shim.json").write_text(
        json.dumps({"pid": os.getpid(), "create_time": shim_process.process_create_time(os.getpid())})
    )
    assert attach.shim_alive(handle)


def test_shim_records_its_own_pid_and_start_time(run_shell, handle):
    import psutil

    def shim_running(info) -> bool:
        try:
            process = psutil.Process(info["pid"])
            return abs(shim_process.process_create_time(process.pid) - info["create_time"]) <= 0.05 and process.status() != "zombie"
        except (OSError, psutil.NoSuchProcess):
            return False  # gone (a reused pid would show another create time)

    result = run_shell({"argv": ["true"]})
    info = json.loads((layout.task_dir(handle) / "shim.json").read_text())
    assert result["status"] == "success"
    assert info["pid"] > 1
    assert abs(info["create_time"] - time.clock_gettime(time.CLOCK_BOOTTIME)) < 60  # seconds after boot
    # Its link said "done" once result.json was written; the shim exits right after.
    assert wait_until(lambda: not shim_running(info))


def test_read_result_is_none_while_running(handle, marker):
    launcher.prepare(
        handle, tool="shell", params={"argv": ["sleep", f"600.{marker}"]}, timeout_s=600, attempt=1, plan=make_plan()
    )
    launcher.launch(handle)
    assert wait_until(lambda: live_processes(marker) != [])
    assert attach.read_result(handle) is None
    assert attach.shim_alive(handle)
    attach.cancel(handle)
    assert attach.wait(handle)["status"] == "cancelled"


def test_a_handle_is_launched_once(handle):
    from runtime.envelopes import EnvelopeError

    launcher.prepare(handle, tool="shell", params={"argv": ["true"]}, timeout_s=5, attempt=1, plan=make_plan())
    launcher.launch(handle)
    with pytest.raises(EnvelopeError) as refused:
        launcher.launch(handle)
    assert refused.value.code == "invalid_input"
    assert attach.wait(handle)["status"] == "success"


def test_prepare_refuses_a_launched_handle(run_shell, handle):
    from runtime.envelopes import EnvelopeError

    run_shell({"argv": ["true"]})
    with pytest.raises(EnvelopeError) as refused:
        launcher.prepare(handle, tool="shell", params={"argv": ["true"]}, timeout_s=5, attempt=1, plan=make_plan())
    assert refused.value.code == "invalid_input"
