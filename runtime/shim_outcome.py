"""How a shell step's command ended, read from the facts the shim gathered
(exit status, signal, rusage, the limits it ran under, its stderr tail).

Part of the shim: imported by a bare interpreter (``python -I -S``), so it
imports only C modules (see the start-up note in shim.py).
"""

import _signal

SIG = _signal
SIGNAL_NAMES = {
    getattr(_signal, name): name
    for name in (
        "SIGHUP SIGINT SIGQUIT SIGILL SIGTRAP SIGABRT SIGBUS SIGFPE SIGKILL SIGUSR1 SIGSEGV "
        "SIGUSR2 SIGPIPE SIGALRM SIGTERM SIGCHLD SIGCONT SIGSTOP SIGXCPU SIGXFSZ SIGSYS"
    ).split()
}
# Ordinary stderr phrases of an allocation refused by RLIMIT_AS: Python's
# MemoryError, glibc/strerror(ENOMEM), C++ std::bad_alloc, GNU tools'
# "memory exhausted", Go's and Rust's allocator panics.
MEMORY_ERROR_MARKERS = (
    b"memoryerror",
    b"cannot allocate memory",
    b"out of memory",
    b"std::bad_alloc",
    b"memory exhausted",
    b"enomem",
    b"failed to allocate",
    b"memory allocation of",
)


def classify(*, reason, exec_error, exit_code, sig, rusage, limits, stderr_tail):
    """How the command ended -> (termination, evidence).

    A wrapper (a shell that forked the command, bubblewrap) reports a child
    killed by signal n as exit code 128+n; that is read back as the signal
    only for SIGXCPU/SIGXFSZ and only when the matching limit was set.
    RLIMIT_AS has no signal: an allocation fails and the program exits
    non-zero (or aborts), so memory_limit is inferred from the stderr tail;
    so is workspace_limit (a write past the sized tmpfs fails with ENOSPC).
    """
    if reason:
        return reason, f"{reason} requested by the shim"
    if exec_error:
        return "exec_failed", f"{exec_error['stage']}: {exec_error['message']}"
    cpu_used = (rusage["utime_s"] + rusage["stime_s"]) if rusage else 0.0
    cpu_limit = limits.get("cpu_seconds")
    inferred = exit_code - 128 if exit_code is not None and exit_code > 128 else None
    if sig == SIG.SIGXCPU or (inferred == SIG.SIGXCPU and cpu_limit):
        return "cpu_limit", "SIGXCPU (RLIMIT_CPU soft limit)"
    if cpu_limit and SIG.SIGKILL in (sig, inferred) and cpu_used >= int(cpu_limit) - 0.05:
        return "cpu_limit", f"SIGKILL after {cpu_used:.2f}s CPU (RLIMIT_CPU hard limit)"
    if sig == SIG.SIGXFSZ or (inferred == SIG.SIGXFSZ and limits.get("file_size_bytes")):
        return "file_size_limit", "SIGXFSZ (RLIMIT_FSIZE)"
    failed = (exit_code not in (None, 0)) or sig in (SIG.SIGABRT, SIG.SIGSEGV, SIG.SIGBUS)
    if failed and limits.get("address_space_bytes"):
        tail = stderr_tail.lower()
        for marker in MEMORY_ERROR_MARKERS:
            if marker in tail:
                return "memory_limit", f"stderr mentions {marker.decode()!r} under RLIMIT_AS"
    if failed and limits.get("workspace_bytes") and b"no space left on device" in stderr_tail.lower():
        return "workspace_limit", "stderr mentions 'No space left on device' under the workspace quota"
    if sig is not None:
        return "signaled", f"killed by {SIGNAL_NAMES.get(sig, sig)}"
    return "exited", f"exit code {exit_code}"
