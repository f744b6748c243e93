"""What a shell step's command left behind, as the shim gathers it, and how
it ended.

- Its output (``CommandOutput``): stdout and stderr each written to its log
  up to the ``log_cap_bytes`` limit (the rest counted as dropped), the tail
  of stderr kept, and stdout's ``::progress <percent> <message>`` lines
  appended to the progress file as JSON.
- Its ending (``classify``): read from the facts gathered (exit status,
  signal, rusage, the limits it ran under, that stderr tail), with
  bubblewrap's word on a command it could not start
  (``bwrap_exec_error``).

Part of the shim: imported by a bare interpreter (``python -I -S``), so it
imports only C modules (see the start-up note in shim.py).
"""

import _signal
import os
import time

if __package__:
    from .shim_process import dumps
else:  # a bare interpreter: the shim's, or the fork server's
    from shim_process import dumps

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
# What of stderr is kept for those phrases (and for ENOSPC).
STDERR_TAIL_BYTES = 4096


class CommandOutput:
    """The command's two streams, by name ("stdout", "stderr"), and what
    became of them."""

    def __init__(self, log_paths, progress_path, log_cap):
        self.log_paths = log_paths  # name -> its log's path
        self.progress_path = progress_path
        self.log_cap = log_cap
        self.logs = {}  # opened on the first byte: a silent command costs no file creation
        self.counts = {"stdout": [0, 0], "stderr": [0, 0]}  # written, dropped
        self.err_tail = b""
        self.pending = b""
        self.progress_fd = None

    def write(self, name, chunk):
        written, dropped = self.counts[name]
        room = len(chunk) if self.log_cap is None else max(0, self.log_cap - written)
        if name not in self.logs:
            self.logs[name] = os.open(self.log_paths[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        if room:
            os.write(self.logs[name], chunk[:room])
        self.counts[name] = [written + min(room, len(chunk)), dropped + max(0, len(chunk) - room)]
        if name == "stdout":
            self._scan_progress(chunk)
        else:
            self.err_tail = (self.err_tail + chunk)[-STDERR_TAIL_BYTES:]

    def _scan_progress(self, chunk):
        data = self.pending + chunk
        if b"::progress" not in data:
            self.pending = data[data.rfind(b"\n") + 1 :][-4096:]
            return
        lines = data.split(b"\n")
        self.pending = lines.pop()[-4096:]
        for line in lines:
            if not line.startswith(b"::progress "):
                continue
            parts = line[len(b"::progress ") :].rstrip(b"\r").split(b" ", 1)
            try:
                percent = int(parts[0])
            except ValueError:
                continue
            if not 0 <= percent <= 100:
                continue
            message = parts[1].decode(errors="replace") if len(parts) > 1 else ""
            if self.progress_fd is None:
                self.progress_fd = os.open(self.progress_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            record = {"percent": percent, "message": message[:1000], "at": time.time()}
            os.write(self.progress_fd, (dumps(record) + "\n").encode())


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


# bubblewrap reports a command it cannot start as "bwrap: execvp <file>: <strerror>", exit code 1.
BWRAP_EXEC_ERRORS = {b"No such file or directory": 2, b"Permission denied": 13, b"Not a directory": 20}


def bwrap_exec_error(stderr_tail):
    """What kept bubblewrap (exit code 1) from starting the command, as the
    shim's exec_error; None when its stderr does not say."""
    for line in stderr_tail.splitlines():
        if line.startswith(b"bwrap: execvp "):
            message = line[len(b"bwrap: execvp "):].decode(errors="replace")
            for text, code in BWRAP_EXEC_ERRORS.items():
                if line.endswith(b": " + text):
                    return {"errno": code, "stage": "exec", "message": message}
            return {"errno": 0, "stage": "exec", "message": message}
    return None
