"""Timeout and cancel kill the whole tree: setsid grandchildren and pipe holders too."""

import threading
import time

import pytest

from runtime import attach, launcher
from tests.runtime.conftest import live_processes, needs_pid_namespace, wait_until

TREE_KILLS = [pytest.param("pid_namespace", marks=needs_pid_namespace()), "process_scan"]


def escaping_tree(marker: str) -> dict:
    # 1: a grandchild in its own session (killpg would miss it), output closed;
    # 2: a background child still holding the stdout pipe;
    # 3: the main command.
    return {
        "script": (
            f"setsid sleep 600.{marker}1 </dev/null >/dev/null 2>&1 &\n"
            f"sleep 600.{marker}2 &\n"
            f"echo started; sleep 600.{marker}3"
        )
    }


@pytest.mark.parametrize("via", ["forkserver", "spawn"])
@pytest.mark.parametrize("tree_kill", TREE_KILLS)
def test_timeout_leaves_no_process(run_shell, marker, tree_kill, via, settings):
    settings.EXECGO_SHIM_FORKSERVER = via == "forkserver"
    result = run_shell(escaping_tree(marker), timeout_s=1, tree_kill=tree_kill)
    assert result["status"] == "failed"
    assert result["details"]["termination"] == "timeout"
    assert result["error"] == {
        "code": "timeout",
        "message": "step exceeded timeout 1000ms",
        "retryable": True,
        "source": "executor",
        "details": {"timeout_ms": 1000},
    }
    assert result["output"]["stdout"] == "started\n"
    assert result["details"]["tree_kill"] == tree_kill
    assert live_processes(marker) == []


@pytest.mark.parametrize("tree_kill", TREE_KILLS)
def test_cancel_leaves_no_process_within_two_seconds(run_shell, handle, marker, tree_kill):
    started = threading.Event()
    asked_at = {}

    def cancel_requested():
        if not started.is_set() and wait_until(lambda: len(live_processes(marker)) >= 3, 0):
            started.set()
            asked_at["t"] = time.monotonic()
        return started.is_set()

    result = run_shell(escaping_tree(marker), timeout_s=600, tree_kill=tree_kill, cancel_requested=cancel_requested)
    finished = time.monotonic()
    assert started.is_set()
    assert result["status"] == "cancelled"
    assert result["error"]["code"] == "cancelled"
    assert result["details"]["termination"] == "cancelled"
    assert finished - asked_at["t"] < 2.0
    assert live_processes(marker) == []


def test_cancel_from_another_thread_by_handle(run_shell, handle, marker):
    def cancel_soon():
        wait_until(lambda: live_processes(marker) != [], 10)
        attach.cancel(handle)

    canceller = threading.Thread(target=cancel_soon)
    canceller.start()
    result = run_shell({"argv": ["sleep", f"600.{marker}"]}, timeout_s=600)
    canceller.join()
    assert result["status"] == "cancelled"
    assert result["details"]["signal_name"] == "SIGTERM"
    assert live_processes(marker) == []


def test_cancel_file_before_start_never_runs_the_command(handle, marker):
    from tests.runtime.conftest import make_plan

    directory = launcher.prepare(
        handle, tool="shell", params={"script": f"touch ran; sleep 600.{marker}"}, timeout_s=60, attempt=1,
        plan=make_plan(),
    )  # fmt: skip
    attach.cancel(handle)
    launcher.launch(handle)
    result = attach.wait(handle)
    assert result["status"] == "cancelled"
    assert not (directory / "workspace" / "ran").exists()
    assert result["output"]["exit_code"] is None


def test_term_ignoring_command_is_killed_after_grace(run_shell, marker, settings):
    settings.EXECGO_KILL_GRACE_S = 0.3
    result = run_shell({"argv": ["/bin/bash", "-c", f"trap '' TERM; sleep 600.{marker}; :"]}, timeout_s=0.5)
    assert result["details"]["termination"] == "timeout"
    assert result["details"]["signal_name"] == "SIGKILL"
    assert live_processes(marker) == []


def test_background_process_left_after_success_is_killed(run_shell, marker):
    result = run_shell({"script": f"sleep 600.{marker} >/dev/null 2>&1 & echo ok"})
    assert result["status"] == "success"
    assert result["output"]["stdout"] == "ok\n"
    assert live_processes(marker) == []
