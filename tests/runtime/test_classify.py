"""How the shim names an ending, from the facts it has."""

import signal

import pytest

from runtime.shim_outcome import classify

RUSAGE = {"utime_s": 0.01, "stime_s": 0.0}


def ending(**facts):
    base = {"reason": None, "exec_error": None, "exit_code": None, "sig": None, "rusage": RUSAGE, "limits": {}}
    return classify(**{**base, "stderr_tail": b"", **facts})[0]


def test_requested_endings_win_over_the_signal():
    assert ending(reason="timeout", sig=signal.SIGKILL) == "timeout"
    assert ending(reason="cancelled", sig=signal.SIGTERM) == "cancelled"


def test_plain_exit_and_signal():
    assert ending(exit_code=0) == "exited"
    assert ending(exit_code=3) == "exited"
    assert ending(sig=signal.SIGSEGV) == "signaled"


def test_wrapper_exit_codes_are_read_back_only_with_the_limit():
    assert ending(exit_code=128 + signal.SIGXFSZ, limits={"file_size_bytes": 1}) == "file_size_limit"
    assert ending(exit_code=128 + signal.SIGXFSZ) == "exited"
    assert ending(exit_code=128 + signal.SIGXCPU, limits={"cpu_seconds": 1}) == "cpu_limit"


def test_sigkill_counts_as_cpu_limit_only_after_the_cpu_was_used():
    spent = {"utime_s": 1.98, "stime_s": 0.01}
    assert ending(sig=signal.SIGKILL, rusage=spent, limits={"cpu_seconds": 1}) == "cpu_limit"
    assert ending(sig=signal.SIGKILL, rusage=RUSAGE, limits={"cpu_seconds": 1}) == "signaled"


@pytest.mark.parametrize(
    "stderr",
    [b"MemoryError", b"x: Cannot allocate memory", b"terminate called after throwing 'std::bad_alloc'",
     b"fatal error: out of memory", b"memory allocation of 1024 bytes failed"],
)  # fmt: skip
def test_memory_limit_from_stderr_under_rlimit_as(stderr):
    limits = {"address_space_bytes": 64 << 20}
    assert ending(exit_code=1, stderr_tail=stderr, limits=limits) == "memory_limit"
    assert ending(sig=signal.SIGABRT, stderr_tail=stderr, limits=limits) == "memory_limit"
    assert ending(exit_code=0, stderr_tail=stderr, limits=limits) == "exited"
    assert ending(exit_code=1, stderr_tail=stderr) == "exited"


def test_exec_failure():
    failure = {"errno": 2, "stage": "exec", "message": "No such file or directory"}
    assert ending(exec_error=failure, exit_code=127) == "exec_failed"
