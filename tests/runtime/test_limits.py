"""Each resource limit ends the command and is classified as that limit."""

import os
import threading

import pytest
from django.conf import settings

from runtime import layout
from tests.runtime.conftest import FORK_BOMB, MIB, SYSTEM_PYTHON, live_processes, needs_bubblewrap, needs_system_python

REPEAT = range(20)


@needs_system_python()
@pytest.mark.parametrize("iteration", REPEAT)
def test_memory_hog_is_memory_limit(run_shell, iteration):
    result = run_shell(
        {"argv": [SYSTEM_PYTHON, "-c", "blocks = [bytearray(64 << 20) for _ in range(64)]"]},
        limits={"address_space_bytes": 256 * MIB},
    )
    assert result["status"] == "failed"
    assert result["details"]["termination"] == "memory_limit"
    assert result["details"]["exit_code"] == 1
    assert "MemoryError" in result["details"]["stderr"]
    assert result["error"]["code"] == "external_failure"
    assert result["error"]["retryable"] is False


def test_memory_hog_without_limit_is_not_memory_limit(run_shell, uncontained):
    # The same stderr without RLIMIT_AS must not be blamed on a limit.
    result = run_shell({"script": "echo 'MemoryError' >&2; exit 1"})
    assert result["details"]["termination"] == "exited"
    assert result["details"]["exit_code"] == 1


@pytest.mark.parametrize("iteration", REPEAT)
def test_cpu_loop_is_cpu_limit(run_shell, iteration):
    result = run_shell({"argv": ["/bin/sh", "-c", "while :; do :; done"]}, limits={"cpu_seconds": 1})
    details = result["details"]
    assert result["status"] == "failed"
    assert details["termination"] == "cpu_limit"
    assert details["signal_name"] == "SIGXCPU"
    # rusage is tick-sampled, RLIMIT_CPU uses exact runtime: compare loosely
    assert details["rusage"]["utime_s"] + details["rusage"]["stime_s"] > 0.5
    assert result["error"]["code"] == "external_failure"


def test_cpu_loop_ignoring_sigxcpu_is_killed_at_hard_limit(run_shell):
    script = "trap '' XCPU; while :; do :; done"
    result = run_shell({"argv": ["/bin/bash", "-c", script]}, limits={"cpu_seconds": 1})
    details = result["details"]
    assert details["signal_name"] == "SIGKILL"
    assert details["termination"] == "cpu_limit"
    assert details["rusage"]["utime_s"] + details["rusage"]["stime_s"] > 1.5


@pytest.mark.parametrize("iteration", REPEAT)
def test_ten_gigabyte_write_is_file_size_limit(run_shell, handle, iteration, uncontained):
    # On the host's filesystem, to read the file back (a contained step's workspace is its own tmpfs).
    result = run_shell(
        {"argv": ["dd", "if=/dev/zero", "of=big.bin", "bs=1M", "count=10240"]},
        limits={"file_size_bytes": 1 * MIB},
    )
    assert result["status"] == "failed"
    assert result["details"]["termination"] == "file_size_limit"
    assert result["details"]["signal_name"] == "SIGXFSZ"
    written = layout.task_dir(handle) / "workspace" / "big.bin"
    assert written.stat().st_size == 1 * MIB


@needs_bubblewrap()
@needs_system_python()
@pytest.mark.parametrize("iteration", range(3))
def test_limits_are_classified_inside_the_sandbox_too(run_shell, handle, iteration):
    # bubblewrap reports a signal as exit code 128+n; the shim reads it back.
    cpu = run_shell(
        {"argv": ["/bin/sh", "-c", "while :; do :; done"]},
        profile="linux_sandbox",
        limits={"cpu_seconds": 1},
        handle_id=f"{handle}-cpu",
    )
    assert cpu["details"]["termination"] == "cpu_limit"
    assert cpu["details"]["exit_code"] == 128 + 24
    size = run_shell(
        {"argv": ["dd", "if=/dev/zero", "of=big.bin", "bs=1M", "count=10240"]},
        profile="linux_sandbox",
        limits={"file_size_bytes": MIB},
        handle_id=f"{handle}-fsize",
    )
    assert size["details"]["termination"] == "file_size_limit"
    memory = run_shell(
        {"argv": [SYSTEM_PYTHON, "-c", "blocks = [bytearray(64 << 20) for _ in range(64)]"]},
        profile="linux_sandbox",
        limits={"address_space_bytes": 256 * MIB},
        handle_id=f"{handle}-mem",
    )
    assert memory["details"]["termination"] == "memory_limit"


@needs_system_python()
@pytest.mark.skipif(os.geteuid() != 0, reason="the uid drop is what a root worker does; others are already non-root")
def test_fork_bomb_as_sandbox_uid_stays_bounded(run_shell, handle, marker):
    limit = 24
    peak = {"count": 0}
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak["count"] = max(peak["count"], len(live_processes(marker)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = run_shell({"argv": [SYSTEM_PYTHON, "-c", FORK_BOMB, marker]}, timeout_s=3, limits={"processes": limit})
    finally:
        done.set()
        sampler.join()
    assert result["details"]["plan"]["uid"] >= settings.EXECGO_SANDBOX_UID
    assert result["details"]["termination"] == "timeout"
    assert 1 < peak["count"] <= limit
    assert live_processes(marker) == []
