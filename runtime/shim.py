"""The shim: one small supervisor process per shell step.

Run as ``python -I -S runtime/shim.py <task_dir>``, or forked by
``runtime/forkserver.py`` (the fast path). It never imports Django: it reads
``<task_dir>/request.json`` written by ``runtime.launcher.prepare`` and
writes facts only (``shim.json`` at start, ``result.json`` at the end);
``runtime.attach.read_result`` turns those facts into the step result envelope.

Process layout, when the plan says ``tree_kill = "pid_namespace"``::

    shim     PID 1 of a new PID namespace (forked there by the fork server,
     │       or started under ``unshare --pid --fork --kill-child``)
     └─ command   PID 2: own session, rlimits, optional uid drop, then exec

The command is never PID 1: PID 1 ignores every signal it has no handler
for, so SIGXCPU and SIGXFSZ would be lost and the limits misclassified.
As PID 1 the shim reaps every orphan and kills the whole tree with
``kill(-1, …)``, which reaches ``setsid`` grandchildren and processes still
holding the stdout pipe; and whatever is left when the shim exits (or is
SIGKILLed) is killed by the kernel with the namespace.

Ending: on timeout or cancel (the ``cancel`` file, or SIGTERM to the shim)
the whole tree gets SIGTERM, then SIGKILL after ``kill_grace_s``. When the
command exits, its output is drained for up to ``drain_grace_s`` and then
everything it left behind is SIGKILLed: a step ends with its main process.

Starting the command: when the plan asks only for what ``posix_spawn`` does
itself (session, descriptors, default signals) and what the shim can carry
for it (RLIMIT_CORE, RLIMIT_NOFILE, the working directory), the command is
spawned (``started_by = "posix_spawn"``); CPU, file-size, process and memory
limits, a uid drop, or a shim outside a PID namespace need code between fork
and exec, so the command is forked (``"fork"``). That is a real ``fork()``,
but of this small interpreter (about 10 MB), not of the worker; the worker
itself starts the shim without ``preexec_fn``.

Start-up is kept cheap: no ``json`` (its import of ``re``/``enum`` costs
about 7 ms on a 2-core VM), no ``signal`` (imports ``enum``), no ``subprocess``; the
C modules ``_json`` and ``_signal`` are used instead. ``ctypes`` (about
3 ms) is loaded only for the process-scan fallback (prctl).

A *pre-started* sandbox (``Prestart``): a spare shim that is told at fork
time which step will most likely be handed to it (its ``preset``: the exact
command, environment, credentials, limits and bubblewrap mounts) starts
that command's sandbox at once, while the worker is still recording the
previous step. bubblewrap sets up its namespaces and mounts and then runs a
gate (``GATE_ARGV``) reading GATE_FD: only the line ``go`` there makes it
exec the command (with GATE_FD closed); end of file, which is all a dead
shim can give it, makes it exit having run nothing. (bubblewrap's own
``--block-fd`` goes on at end of file: a shim killed at the wrong moment
would start a step nobody claimed.) On ``go <task_dir>`` the
shim writes ``go`` only if the step's request asks for exactly the preset
and the sandbox is still up; otherwise it kills that sandbox and starts the
command the usual way. The step's uid, limits and mounts are thus the same
either way; only the wait for bubblewrap is off the step's path.

``ru_maxrss`` is the kernel's high-water mark for the command's process;
a forked command's includes its moments as a fork of the shim before exec
(about 9 MB).
"""

import _signal
import os
import select
import sys
import time

if __package__:
    from . import shim_process as proc
    from .shim_outcome import SIGNAL_NAMES, classify
else:  # a bare interpreter: python -I -S runtime/shim.py, or the fork server
    if __name__ == "__main__":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import shim_process as proc
    from shim_outcome import SIGNAL_NAMES, classify

REQUEST_FILE = "request.json"
RESULT_FILE = "result.json"
SHIM_FILE = "shim.json"
CANCEL_FILE = "cancel"
STDOUT_FILE = "stdout.log"
STDERR_FILE = "stderr.log"
PROGRESS_FILE = "progress.jsonl"
STDIN_FILE = "stdin"
SHIM_ERR_FILE = "shim.err"
MARKER_ENV = "EXECGO_HANDLE_ID"

SIG = _signal
# What of a request decides how its command is started: a pre-started
# sandbox serves a request only if these are what it was started with.
PRESET_FIELDS = ("argv", "cwd", "env", "sandbox_argv", "isolation", "own_proc", "seccomp", "stdin", "limits", "uid",
                 "gid", "tree_kill")
# The gate a pre-started sandbox waits at: /bin/sh reads GATE_FD and execs
# the command only on the line "go", with GATE_FD closed. Only a step whose
# environment and program the shell passes on as they are gets one
# (``launcher.sandbox_preset``); PWD is bubblewrap's (--chdir sets it).
GATE_SCRIPT = f'read -r go <&{proc.GATE_FD} && [ "$go" = go ] && exec "$@" {proc.GATE_FD}<&-'
GATE_ARGV = ["/bin/sh", "-c", GATE_SCRIPT, "execgo-gate"]
GO = b"go\n"
STDERR_TAIL_BYTES = 4096
CANCEL_POLL_S = 0.05
READ_CHUNK = 65536


# --- the supervisor --------------------------------------------------------------


class Prestart:
    """A sandbox started for a step before the step was known (see the
    module docstring); forked by a spare shim that is PID 1 of its own PID
    namespace, so nothing of it outlives the spare."""

    def __init__(self, preset):
        self.preset = preset
        self.taken = self.discarded = False
        req = dict(preset, sandbox_argv=list(preset["sandbox_argv"]) + GATE_ARGV)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        gate_r, self.gate_w = os.pipe()
        self.exec_pipe, exec_w = os.pipe()
        stdin_fd = os.open(os.devnull, os.O_RDONLY)
        theirs = (out_w, err_w, gate_r, exec_w, stdin_fd)
        try:
            self.pid = os.fork()
        except OSError:
            for fd in (*theirs, out_r, err_r, self.gate_w, self.exec_pipe):
                os.close(fd)
            raise
        if self.pid == 0:
            for fd in (out_r, err_r, self.gate_w, self.exec_pipe):
                os.close(fd)
            proc.exec_command(req, stdin_fd, out_w, err_w, exec_w, set_pdeathsig=False, gate_fd=gate_r)
        for fd in theirs:
            os.close(fd)
        self.pipes = {out_r: "stdout", err_r: "stderr"}

    @classmethod
    def start(cls, preset_text):
        """A Prestart for a preset as the launcher sent it, or None when it
        cannot be started here (nothing is then left running)."""
        try:
            preset = proc.loads(preset_text)
            if not (isinstance(preset, dict) and preset.get("sandbox_argv") and os.getpid() == 1):
                return None
            return cls(preset)
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def take(self, req):
        """Let the sandbox run ``req``'s command -> its pid; or discard it
        (-> None) when ``req`` asks for anything else or the sandbox is gone."""
        failure = b""
        while chunk := os.read(self.exec_pipe, 4096):  # EOF once bubblewrap was exec'd, or its child failed
            failure += chunk
        os.close(self.exec_pipe)
        self.exec_pipe = None
        wanted = {name: req.get(name) for name in PRESET_FIELDS}
        if failure or wanted != self.preset or os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
            self.discard()
            return None
        os.write(self.gate_w, GO)
        os.close(self.gate_w)
        self.taken = True
        return self.pid

    def discard(self):
        """Kill the sandbox before its gate opened and reap it (idempotent;
        nothing once taken)."""
        if self.taken or self.discarded:
            return
        self.discarded = True
        # As PID 1 of the namespace: bubblewrap and whatever it started (the
        # gate), which can thus no longer run when its gate closes below.
        for pid in (self.pid, -1):
            try:
                os.kill(pid, SIG.SIGKILL)
            except ProcessLookupError:
                pass
        os.waitpid(self.pid, 0)
        for fd in [self.gate_w, self.exec_pipe, *self.pipes]:
            if fd is not None:
                os.close(fd)


class Supervisor:
    def __init__(self, task_dir, req, prestarted=None):
        self.task_dir = task_dir
        self.req = req
        self.prestarted = prestarted
        self.limits = req.get("limits") or {}
        self.log_cap = self.limits.get("log_cap_bytes")
        self.timeout_s = float(req.get("timeout_s") or 0) or None
        self.kill_grace_s = float(req.get("kill_grace_s", 0.5))
        self.drain_grace_s = float(req.get("drain_grace_s", 0.2))
        self.marker = f"{MARKER_ENV}={req.get('handle_id', '')}\0".encode()
        self.notes = []
        self.reason = None  # "timeout" | "cancelled"
        self.signal_flag = False
        self.main_status = None  # (wait status, rusage) | "lost"
        self.exec_error = None
        self.tree_kill = req.get("tree_kill", "process_scan")
        self.counts = {"stdout": [0, 0], "stderr": [0, 0]}  # written, dropped
        self.err_tail = b""
        self.pending = b""
        self.progress_fd = None
        self.exec_pipe = None  # read end of the forked child's failure report
        self.started_by = None  # "posix_spawn" | "fork" | "prestart"
        self.next_cancel_check = 0.0
        self.started_at = self.finished_at = time.time()

    def path(self, name):
        return os.path.join(self.task_dir, name)

    # signals ------------------------------------------------------------
    def _install_signals(self):
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        _signal.set_wakeup_fd(self.wake_w)

        def on_term(*_):
            self.signal_flag = True

        for sig in (SIG.SIGTERM, SIG.SIGINT, SIG.SIGHUP):
            _signal.signal(sig, on_term)
        _signal.signal(SIG.SIGCHLD, _signal.SIG_DFL)

    def _cancel_requested(self):
        if self.signal_flag:
            return True
        now = time.monotonic()
        if now < self.next_cancel_check:
            return False
        self.next_cancel_check = now + CANCEL_POLL_S
        return os.path.exists(self.path(CANCEL_FILE))

    # start ----------------------------------------------------------------
    def run(self):
        self._install_signals()
        if self._cancel_requested():
            self.reason = "cancelled"
            self.notes.append("cancelled before start")
            return self.outcome()
        try:
            self._start()
            if hasattr(self, "main_pid"):  # else it could not be spawned (exec_error says why)
                self._supervise()
        except BaseException:
            if hasattr(self, "main_pid") and self.main_status is None:
                self._signal_tree(SIG.SIGKILL)
            self._kill_leftovers()
            raise
        return self.outcome()

    def _start(self):
        req = self.req
        self.logs = {}  # opened on the first byte: a silent command costs no file creation
        self.pidns = os.getpid() == 1
        if self.prestarted is not None:
            self.started_at = time.time()
            self.t0 = time.monotonic()
            pid = self.prestarted.take(req)
            if pid is not None:
                self.started_by = "prestart"
                self.pipes = dict(self.prestarted.pipes)
                self.main_pid = pid
                self.main_pidfd = os.pidfd_open(pid)
                return
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        stdin_fd = os.open(self.path(STDIN_FILE) if req.get("stdin") else os.devnull, os.O_RDONLY)
        self.pipes = {out_r: "stdout", err_r: "stderr"}
        if not self.pidns:
            if self.tree_kill == "pid_namespace":
                self.notes.append("not started in a PID namespace; killing by process scan")
            self.tree_kill = "process_scan"
            try:  # orphaned descendants are reparented to us, where the scan finds them
                proc.libc_call("prctl", proc.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
            except OSError as exc:
                self.notes.append(f"cannot become a child subreaper ({exc})")
        self.started_at = time.time()
        self.t0 = time.monotonic()
        if proc.spawnable(req, self.pidns):
            self.started_by = "posix_spawn"
            pid, self.exec_error = proc.spawn_command(req, stdin_fd, out_w, err_w)
        else:
            self.started_by = "fork"
            pid = self._fork_command(stdin_fd, out_w, err_w, out_r, err_r)
        for fd in (out_w, err_w, stdin_fd):
            os.close(fd)
        if pid is None:  # nothing started: exec_error says why
            for fd in list(self.pipes):
                self._close_pipe(fd)
            return
        self.main_pid = pid
        self.main_pidfd = os.pidfd_open(pid)
        if self.exec_pipe is not None:
            failure = b""
            while chunk := os.read(self.exec_pipe, 4096):  # EOF at exec (close-on-exec) or exit
                failure += chunk
            os.close(self.exec_pipe)
            if failure:
                code, stage, message = (failure.decode(errors="replace").split("\t", 2) + ["", ""])[:3]
                self.exec_error = {"errno": int(code or 0), "stage": stage, "message": message}

    def _fork_command(self, stdin_fd, out_w, err_w, out_r, err_r):
        """Fork a child that sets the limits and credentials, then execs;
        a failure before exec comes back on ``self.exec_pipe``."""
        self.exec_pipe, exec_w = os.pipe()
        # Blocked across fork: a SIGTERM aimed at the command before it has
        # reset its handlers stays pending instead of running ours in it.
        _signal.pthread_sigmask(_signal.SIG_BLOCK, [SIG.SIGTERM])
        pid = os.fork()
        if pid == 0:
            os.close(out_r)
            os.close(err_r)
            proc.exec_command(self.req, stdin_fd, out_w, err_w, exec_w, set_pdeathsig=not self.pidns)
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, [SIG.SIGTERM])
        os.close(exec_w)
        return pid

    # main loop ----------------------------------------------------------------
    def _supervise(self):
        poller = select.poll()
        for fd in list(self.pipes) + [self.wake_r, self.main_pidfd]:
            poller.register(fd, select.POLLIN)
        deadline = self.t0 + self.timeout_s if self.timeout_s else None
        kill_level, kill_at, drain_until, leftovers_killed = 0, None, None, False
        while self.pipes or self.main_status is None:
            now = time.monotonic()
            if self.main_status is None and self.reason is None:
                if self._cancel_requested():
                    self.reason = "cancelled"
                elif deadline is not None and now >= deadline:
                    self.reason = "timeout"
                if self.reason:
                    kill_level, kill_at = 1, now + self.kill_grace_s
                    self._signal_tree(SIG.SIGTERM)
            if kill_level == 1 and now >= kill_at and self.main_status is None:
                kill_level, kill_at = 2, now + 2.0
                self._signal_tree(SIG.SIGKILL)
            if kill_level == 2 and now >= kill_at and self.main_status is None:
                self.notes.append("command did not die after SIGKILL; giving up on its status")
                self.main_status = "lost"
            if self.main_status is not None and not leftovers_killed:
                if drain_until is None:
                    drain_until = now + self.drain_grace_s
                if not self.pipes or now >= drain_until:
                    self._kill_leftovers()
                    leftovers_killed, drain_until = True, now + 1.0
            if leftovers_killed and self.pipes and now >= drain_until:
                self.notes.append("output pipes still open after killing every process; closed")
                for fd in list(self.pipes):
                    poller.unregister(fd)
                    self._close_pipe(fd)
                break
            waits = [CANCEL_POLL_S if self.main_status is None else 1.0]
            for moment in (deadline if kill_level == 0 else None, kill_at, drain_until):
                if moment is not None:
                    waits.append(moment - now)
            timeout_ms = max(0, int(min(waits) * 1000) + 1)
            for fd, _event in poller.poll(timeout_ms):
                if fd in self.pipes:
                    if not self._read_pipe(fd):
                        poller.unregister(fd)
                elif fd == self.wake_r:
                    try:
                        os.read(self.wake_r, 512)
                    except BlockingIOError:
                        pass
                elif fd == self.main_pidfd:
                    poller.unregister(fd)
                    os.close(fd)
                    self._reap()
        if not leftovers_killed:
            self._kill_leftovers()

    def _signal_tree(self, sig):
        if self.pidns:
            try:
                os.kill(-1, sig)  # from PID 1: every process of the namespace but us
            except ProcessLookupError:
                pass
            return
        targets = proc.scan_descendants(os.getpid(), self.marker)
        try:
            os.killpg(self.main_pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in targets:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _kill_leftovers(self):
        """SIGKILL and reap everything the command left behind."""
        if not hasattr(self, "main_pid"):
            return
        give_up = time.monotonic() + 2.0
        pause = 0.0001  # killed processes are gone in well under a millisecond, a namespace's teardown in a few
        while True:
            if self.pidns:
                self._signal_tree(SIG.SIGKILL)
                remaining = self._reap()  # every process of the namespace is our descendant
            else:
                targets = proc.scan_descendants(os.getpid(), self.marker)
                for pid in targets:
                    try:
                        os.kill(pid, SIG.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                remaining = self._reap() or bool(targets)
            if not remaining:
                return
            if time.monotonic() > give_up:
                self.notes.append("processes were still alive 2 s after the final SIGKILL")
                return
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    def _reap(self):
        """Reap every finished child; True if there may be children left."""
        while True:
            try:
                pid, status, ru = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return False
            if pid == 0:
                return True
            if pid == self.main_pid:
                self.main_status = (status, proc.rusage_dict(ru))

    def _read_pipe(self, fd):
        chunk = os.read(fd, READ_CHUNK)
        if not chunk:
            self._close_pipe(fd)
            return False
        name = self.pipes[fd]
        written, dropped = self.counts[name]
        room = len(chunk) if self.log_cap is None else max(0, self.log_cap - written)
        if name not in self.logs:
            log_name = STDOUT_FILE if name == "stdout" else STDERR_FILE
            self.logs[name] = os.open(self.path(log_name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        if room:
            os.write(self.logs[name], chunk[:room])
        self.counts[name] = [written + min(room, len(chunk)), dropped + max(0, len(chunk) - room)]
        if name == "stdout":
            self._scan_progress(chunk)
        else:
            self.err_tail = (self.err_tail + chunk)[-STDERR_TAIL_BYTES:]
        return True

    def _close_pipe(self, fd):
        os.close(fd)
        del self.pipes[fd]

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
                self.progress_fd = os.open(self.path(PROGRESS_FILE), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            record = {"percent": percent, "message": message[:1000], "at": time.time()}
            os.write(self.progress_fd, (proc.dumps(record) + "\n").encode())

    # classification --------------------------------------------------------------
    def outcome(self):
        self.finished_at = time.time()
        status = rusage = None
        if isinstance(self.main_status, tuple):
            status, rusage = self.main_status
        exit_code = sig = None
        if status is not None:
            if os.WIFEXITED(status):
                exit_code = os.WEXITSTATUS(status)
            elif os.WIFSIGNALED(status):
                sig = os.WTERMSIG(status)
        if self.exec_error is None and exit_code == 1 and self.req.get("sandbox_argv"):
            self.exec_error = _bwrap_exec_error(self.err_tail)
        termination, evidence = classify(
            reason=self.reason,
            exec_error=self.exec_error,
            exit_code=exit_code,
            sig=sig,
            rusage=rusage,
            limits=self.limits,
            stderr_tail=self.err_tail,
        )
        return {
            "version": 1,
            "handle_id": self.req.get("handle_id"),
            "termination": termination,
            "evidence": evidence,
            "exit_code": exit_code,
            "signal": sig,
            "signal_name": SIGNAL_NAMES.get(sig) if sig else None,
            "exec_error": self.exec_error,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "duration_ms": int(round((self.finished_at - self.started_at) * 1000)),
            "stdout_bytes": self.counts["stdout"][0],
            "stderr_bytes": self.counts["stderr"][0],
            "stdout_truncated_bytes": self.counts["stdout"][1],
            "stderr_truncated_bytes": self.counts["stderr"][1],
            "rusage": rusage,
            "tree_kill": self.tree_kill,
            "started_by": self.started_by,
            "notes": self.notes,
            "shim_error": None,
        }


# bubblewrap reports a command it cannot start as "bwrap: execvp <file>: <strerror>", exit code 1.
BWRAP_EXEC_ERRORS = {b"No such file or directory": 2, b"Permission denied": 13, b"Not a directory": 20}


def _bwrap_exec_error(stderr_tail):
    for line in stderr_tail.splitlines():
        if line.startswith(b"bwrap: execvp "):
            message = line[len(b"bwrap: execvp "):].decode(errors="replace")
            for text, code in BWRAP_EXEC_ERRORS.items():
                if line.endswith(b": " + text):
                    return {"errno": code, "stage": "exec", "message": message}
            return {"errno": 0, "stage": "exec", "message": message}
    return None


# --- entry points -------------------------------------------------------------------


def main(task_dir, *, forked=False, link=None, prestarted=None):
    """Supervise the step in task_dir; always leaves a result.json behind.

    ``forked``: called in a fork of the fork server, whose stdio is not ours;
    started by ``posix_spawn`` instead, stderr already is ``shim.err``.
    ``link``: the launcher's connection, when forked (see forkserver.py).
    ``prestarted``: a spare's ``Prestart``, used if the step is its preset.
    """
    task_dir = os.path.abspath(task_dir)
    if forked:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
    pid = int(os.readlink("/proc/self"))  # our pid in the host namespace, even as PID 1
    # A plain write, not write-then-rename: one file creation fewer per step;
    # readers treat a partial shim.json as absent and fall back to launch.json.
    info = {"pid": pid, "create_time": proc.process_create_time(pid), "started_at": time.time()}
    fd = os.open(os.path.join(task_dir, SHIM_FILE), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, proc.dumps(info).encode())
    os.close(fd)
    supervisor = None
    try:
        req = proc.loads(proc.read_file(os.path.join(task_dir, REQUEST_FILE)).decode())
        supervisor = Supervisor(task_dir, req, prestarted)
        result = supervisor.run()
    except BaseException as exc:
        import traceback  # only on failure: it costs start-up time

        with open(os.path.join(task_dir, SHIM_ERR_FILE), "a") as err:
            traceback.print_exc(file=err)
        result = supervisor.outcome() if supervisor else {"version": 1, "termination": None}
        result["shim_error"] = f"{type(exc).__name__}: {exc}"
    if prestarted is not None:
        prestarted.discard()  # not taken (a cancel before the start, a failure): its gate never opens
    proc.write_json_atomic(os.path.join(task_dir, RESULT_FILE), result)
    if link is not None:
        try:
            link.sendall(b"done\n")
        except OSError:
            pass  # the launcher is gone (SIGPIPE is ignored, as in any Python process): one re-attaches by pid
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--probe":
        sys.exit(proc.probe())
    if len(sys.argv) != 2:
        sys.stderr.write("usage: shim.py <task_dir> | --probe\n")
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
