"""Output capture: log caps, tails, progress lines, stdin, environment, exit codes."""

import os

import psutil
import pytest

from runtime import attach, executor, layout
from tests.runtime.conftest import make_plan


def test_yes_with_small_log_cap_keeps_cap_and_counts_the_rest(run_shell, handle):
    cap = 64 * 1024
    result = run_shell({"argv": ["yes"]}, timeout_s=2, limits={"log_cap_bytes": cap})
    log = layout.task_dir(handle) / "stdout.log"
    assert result["details"]["termination"] == "timeout"
    assert log.stat().st_size == cap
    assert log.read_bytes() == b"y\n" * (cap // 2)
    assert result["details"]["stdout_truncated_bytes"] > 0
    assert result["details"]["stdout_bytes"] == cap


def test_zero_log_cap_writes_nothing_but_counts(run_shell, handle):
    result = run_shell({"script": "head -c 5000 /dev/zero; head -c 300 /dev/zero >&2"}, limits={"log_cap_bytes": 0})
    assert result["status"] == "success"
    assert (layout.task_dir(handle) / "stdout.log").stat().st_size == 0
    assert result["details"]["stdout_truncated_bytes"] == 5000
    assert result["details"]["stderr_truncated_bytes"] == 300


def test_stdout_in_output_is_capped_to_the_tail(run_shell, settings):
    settings.EXECGO_OUTPUT_TAIL_BYTES = 10
    result = run_shell({"script": "printf 'head-0123456789-tail\\n'"})
    assert result["output"]["stdout"] == "456789-tail\n"[-10:]
    assert result["details"]["stdout_bytes"] == 21


def test_success_envelope_shape(run_shell, handle):
    result = run_shell({"script": "echo out; echo err >&2"})
    assert set(result) == {
        "status", "handle_id", "output", "started_at", "finished_at", "duration_ms", "attempt", "details", "error",
    }  # fmt: skip
    assert result["status"] == "success"
    assert result["handle_id"] == handle
    assert result["output"] == {"exit_code": 0, "stdout": "out\n"}
    assert result["details"]["stderr"] == "err\n"
    assert result["details"]["exit_code"] == 0
    assert result["details"]["termination"] == "exited"
    assert result["details"]["rusage"]["maxrss_kb"] > 0
    assert result["started_at"].endswith("Z") and result["finished_at"].endswith("Z")
    assert result["error"] is None
    assert attach.read_result(handle) == result


def test_non_zero_exit_is_failed_external_failure(run_shell):
    result = run_shell({"argv": ["sh", "-c", "exit 7"]})
    assert result["status"] == "failed"
    assert result["output"]["exit_code"] == 7
    assert result["error"]["code"] == "external_failure"
    assert result["error"]["retryable"] is True  # the step's own ``retries`` decides
    assert result["error"]["details"]["exit_code"] == 7


def test_killed_by_signal_is_signaled(run_shell):
    result = run_shell({"argv": ["sh", "-c", "kill -SEGV $$"]})
    assert result["details"]["termination"] == "signaled"
    assert result["details"]["signal_name"] == "SIGSEGV"
    assert result["output"]["exit_code"] is None


def test_missing_program_is_not_found(run_shell):
    result = run_shell({"argv": ["definitely-not-a-program-xyz"]})
    assert result["details"]["termination"] == "exec_failed"
    assert result["error"]["code"] == "not_found"


def test_progress_lines_reach_the_callback_and_the_file(run_shell, handle):
    seen = []
    script = "echo '::progress 10 fetching'; echo '::progress 200 bogus'; echo plain; echo '::progress 90 almost'"
    result = run_shell({"script": script}, on_progress=lambda percent, message: seen.append((percent, message)))
    assert result["status"] == "success"
    assert seen == [(10, "fetching"), (90, "almost")]
    lines = (layout.task_dir(handle) / "progress.jsonl").read_text().splitlines()
    assert len(lines) == 2


def test_progress_line_split_across_reads(run_shell):
    seen = []
    script = "printf '::prog'; sleep 0.2; printf 'ress 42 split\\n'"
    run_shell({"script": script}, on_progress=lambda p, m: seen.append((p, m)))
    assert seen == [(42, "split")]


def test_stdin_is_fed(run_shell):
    result = run_shell({"argv": ["tr", "a-z", "A-Z"], "stdin": "hello\n"})
    assert result["output"]["stdout"] == "HELLO\n"


def test_environment_is_clean_and_filtered(run_shell, monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgres://secret")
    result = run_shell(
        {"argv": ["env"], "env": {"STEP_COLOR": "blue", "LD_PRELOAD": "/tmp/evil.so", "PATH": "/tmp/evil"}}
    )
    env = dict(line.split("=", 1) for line in result["output"]["stdout"].splitlines())
    assert env["STEP_COLOR"] == "blue"
    assert "DATABASE_URL" not in env
    assert "LD_PRELOAD" not in env
    assert env["PATH"] != "/tmp/evil"
    assert env["EXECGO_HANDLE_ID"] == result["handle_id"]
    assert result["details"]["env_dropped"] == ["LD_PRELOAD", "PATH"]


def test_cwd_inside_workspace(run_shell, handle):
    result = run_shell({"argv": ["pwd"], "cwd": "sub/dir"})
    assert result["output"]["stdout"].strip() == str(layout.task_dir(handle) / "workspace" / "sub" / "dir")


@pytest.mark.parametrize(
    "params, code",
    [
        ({"argv": []}, "invalid_input"),
        ({"argv": ["a"], "script": "b"}, "invalid_input"),
        ({"script": "   "}, "invalid_input"),
        ({"argv": ["ls"], "cwd": "../.."}, "denied"),
        ({"argv": ["ls"], "cwd": "/etc"}, "denied"),
        ({"argv": ["ls"], "env": {"BAD NAME": "x"}}, "invalid_input"),
        ({"argv": ["ls"], "extra": 1}, "invalid_input"),
    ],
)
def test_bad_params_fail_before_anything_runs(handle, params, code):
    result = executor.execute(handle, tool="shell", params=params, timeout_s=5, attempt=2, plan=make_plan())
    assert result["status"] == "failed"
    assert result["error"]["code"] == code
    assert result["attempt"] == 2
    assert not os.path.exists(layout.task_dir(handle) / "request.json")


def test_a_flood_of_output_does_not_grow_the_worker(run_shell, handle):
    """The shim, not the worker, reads the command's output: the worker's
    memory stays flat however much the command prints (bench/bench_log_flood.py
    runs the 60 s version and prints the figures)."""
    cap = 1024 * 1024
    worker = psutil.Process()
    before = worker.memory_info().rss
    result = run_shell({"argv": ["yes"]}, timeout_s=5, limits={"log_cap_bytes": cap})
    grown = worker.memory_info().rss - before
    assert result["details"]["termination"] == "timeout"
    assert (layout.task_dir(handle) / "stdout.log").stat().st_size == cap
    assert result["details"]["stdout_truncated_bytes"] > 100 * cap  # it really flooded
    assert grown < 50 * 1024 * 1024
