"""A step's sandbox started before the step is known (``Prestart``).

A spare shim (see runtime/forkserver.py) that is told at fork time which
step will most likely be handed to it (its ``preset``: the exact command,
environment, credentials, limits and bubblewrap mounts) starts that
command's sandbox at once, while the worker is still recording the
previous step. bubblewrap sets up its namespaces and mounts and then runs a
gate (``GATE_ARGV``) reading GATE_FD: only the line ``go`` there makes it
exec the command (with GATE_FD closed); end of file, which is all a dead
shim can give it, makes it exit having run nothing. (bubblewrap's own
``--block-fd`` goes on at end of file: a shim killed at the wrong moment
would start a step nobody claimed.) On ``go <task_dir>`` the shim writes
``go`` only if the step's request asks for exactly the preset and the
sandbox is still up; otherwise it kills that sandbox and starts the
command the usual way. The step's uid, limits and mounts are thus the same
either way; only the wait for bubblewrap is off the step's path.

Part of the shim, loaded by the fork server (only a spare pre-starts): it
imports only C modules (see the start-up note in shim.py).
"""

import _signal
import os

if __package__:
    from .shim_exec import GATE_FD, exec_command, exec_failure
    from .shim_process import loads
else:  # a bare interpreter: the fork server's
    from shim_exec import GATE_FD, exec_command, exec_failure
    from shim_process import loads

SIG = _signal
# What of a request decides how its command is started: a pre-started
# sandbox serves a request only if these are what it was started with.
PRESET_FIELDS = ("argv", "cwd", "env", "sandbox_argv", "isolation", "own_proc", "seccomp", "stdin", "limits", "uid",
                 "gid", "tree_kill")
# The gate a pre-started sandbox waits at: /bin/sh reads GATE_FD and execs
# the command only on the line "go", with GATE_FD closed. Only a step whose
# environment and program the shell passes on as they are gets one
# (``launcher.sandbox_preset``); PWD is bubblewrap's (--chdir sets it).
GATE_SCRIPT = f'read -r go <&{GATE_FD} && [ "$go" = go ] && exec "$@" {GATE_FD}<&-'
GATE_ARGV = ["/bin/sh", "-c", GATE_SCRIPT, "execgo-gate"]
GO = b"go\n"


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
            exec_command(req, stdin_fd, out_w, err_w, exec_w, set_pdeathsig=False, gate_fd=gate_r)
        for fd in theirs:
            os.close(fd)
        self.pipes = {out_r: "stdout", err_r: "stderr"}

    @classmethod
    def start(cls, preset_text):
        """A Prestart for a preset as the launcher sent it, or None when it
        cannot be started here (nothing is then left running)."""
        try:
            preset = loads(preset_text)
            if not (isinstance(preset, dict) and preset.get("sandbox_argv") and os.getpid() == 1):
                return None
            return cls(preset)
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def take(self, req):
        """Let the sandbox run ``req``'s command -> its pid; or discard it
        (-> None) when ``req`` asks for anything else or the sandbox is gone."""
        failure = exec_failure(self.exec_pipe)  # at EOF: once bubblewrap was exec'd, or its child failed
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
