"""The shim: one small supervisor process per shell step.

Run as ``python -I -S runtime/shim.py <task_dir>``, or forked by the fork
server (``runtime/forkserver_daemon.py``, the fast path). It never imports
Django: it reads ``<task_dir>/request.json`` written by
``runtime.launcher.prepare`` and writes facts only (``shim.json`` at start,
``result.json`` at the end); ``runtime.attach.read_result`` turns those
facts into the step result envelope.

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

Starting the command (runtime/shim_exec.py): by ``posix_spawn`` when the
plan asks only for what it does itself and what the shim can carry for the
command (``started_by = "posix_spawn"``); by a real ``fork()`` otherwise
(``"fork"``), but of this small interpreter (about 10 MB), not of the
worker; the worker itself starts the shim without ``preexec_fn``. A spare
shim may have had its step's sandbox started ahead, held at a gate
(``"prestart"``, runtime/shim_prestart.py).

Start-up is kept cheap: no ``json`` (its import of ``re``/``enum`` costs
about 7 ms on a 2-core VM), no ``signal`` (imports ``enum``), no ``subprocess``; the
C modules ``_json`` and ``_signal`` are used instead. ``ctypes`` (about
3 ms) is loaded only for the process-scan fallback (prctl).

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
    from . import shim_exec as command
    from . import shim_process as proc
    from .shim_outcome import SIGNAL_NAMES, CommandOutput, bwrap_exec_error, classify
else:  # a bare interpreter: python -I -S runtime/shim.py, or the fork server
    if __name__ == "__main__":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import shim_exec as command
    import shim_process as proc
    from shim_outcome import SIGNAL_NAMES, CommandOutput, bwrap_exec_error, classify

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
CANCEL_POLL_S = 0.05
READ_CHUNK = 65536


# --- the supervisor --------------------------------------------------------------


class Supervisor:
    def __init__(self, task_dir, req, prestarted=None):
        self.task_dir = task_dir
        self.req = req
        self.prestarted = prestarted
        self.limits = req.get("limits") or {}
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
        self.output = CommandOutput({"stdout": self.path(STDOUT_FILE), "stderr": self.path(STDERR_FILE)},
                                    self.path(PROGRESS_FILE), self.limits.get("log_cap_bytes"))
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
        if command.spawnable(req, self.pidns):
            self.started_by = "posix_spawn"
            pid, self.exec_error = command.spawn_command(req, stdin_fd, out_w, err_w)
        else:
            self.started_by = "fork"
            pid, exec_pipe = command.fork_command(req, stdin_fd, out_w, err_w, (out_r, err_r),
                                                  set_pdeathsig=not self.pidns)
        for fd in (out_w, err_w, stdin_fd):
            os.close(fd)
        if pid is None:  # nothing started: exec_error says why
            for fd in list(self.pipes):
                self._close_pipe(fd)
            return
        self.main_pid = pid
        self.main_pidfd = os.pidfd_open(pid)
        if self.started_by == "fork":
            self.exec_error = command.exec_failure(exec_pipe)

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
        proc.signal_tree(sig, pidns=self.pidns, main_pid=self.main_pid, marker=self.marker)

    def _kill_leftovers(self):
        """SIGKILL and reap everything the command left behind."""
        if not hasattr(self, "main_pid"):
            return
        if not proc.kill_tree(pidns=self.pidns, main_pid=self.main_pid, marker=self.marker, reap=self._reap):
            self.notes.append("processes were still alive 2 s after the final SIGKILL")

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
        self.output.write(self.pipes[fd], chunk)
        return True

    def _close_pipe(self, fd):
        os.close(fd)
        del self.pipes[fd]

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
            self.exec_error = bwrap_exec_error(self.output.err_tail)
        termination, evidence = classify(
            reason=self.reason,
            exec_error=self.exec_error,
            exit_code=exit_code,
            sig=sig,
            rusage=rusage,
            limits=self.limits,
            stderr_tail=self.output.err_tail,
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
            "stdout_bytes": self.output.counts["stdout"][0],
            "stderr_bytes": self.output.counts["stderr"][0],
            "stdout_truncated_bytes": self.output.counts["stdout"][1],
            "stderr_truncated_bytes": self.output.counts["stderr"][1],
            "rusage": rusage,
            "tree_kill": self.tree_kill,
            "started_by": self.started_by,
            "notes": self.notes,
            "shim_error": None,
        }


# --- entry points -------------------------------------------------------------------


def main(task_dir, *, forked=False, link=None, prestarted=None):
    """Supervise the step in task_dir; always leaves a result.json behind.

    ``forked``: called in a fork of the fork server, whose stdio is not ours;
    started by ``posix_spawn`` instead, stderr already is ``shim.err``.
    ``link``: the launcher's connection, when forked (see forkserver.py).
    ``prestarted``: a spare's ``shim_prestart.Prestart``, used if the step is its preset.
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
        import shim_probe  # only the capability probe needs it

        sys.exit(shim_probe.probe())
    if len(sys.argv) != 2:
        sys.stderr.write("usage: shim.py <task_dir> | --probe\n")
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
