"""Fork server for shims: the fast way to start one, as its clients see it.

A fresh ``python -I -S shim.py`` costs 7-10 ms of interpreter start-up per
step. The fork server (runtime/forkserver_daemon.py) is that interpreter
started once (per tasks directory), with the shim and ctypes already
imported; for each step it forks a copy (well under a millisecond for a
~15 MB process) that runs ``shim.main``, as PID 1 of a fresh PID namespace
when the plan asks for one. It runs detached in its own session, one per
tasks directory, talks only to its own user over a 0600 Unix socket, and
exits when idle or when the shim code changed (see its module docstring).

Clients (``runtime.launcher``) call ``spawn_shim``; on any failure they start
the shim directly instead, so the server is an optimisation, never a
dependency. ``start_server`` starts one.

The client's connection goes with the shim (a ``ShimLink``): the server
answers ``ok <pid> <create_time>`` once it has forked, and the shim says
``done`` on the same connection once its result.json is written, so the
launcher wakes the moment the result exists, not once the shim and its PID
namespace are torn down. EOF without ``done`` means the shim died first.
Nothing depends on the link: a shim whose launcher is gone finishes all the
same, and is re-attached by its pid.

A *spare* is a shim forked before its step is known (``spare_shim``): it
waits on its link for ``go <task_dir>`` (``ShimLink.go``), so a worker that
knows another step will follow can have the fork done while it records the
step that ended. A spare whose link closes (or that waits a minute) exits
without running anything. A spare asked for with a *preset* (the exec
fields of the request its step will most likely have) also starts that
step's sandbox at once and holds it at a gate (``shim_prestart.Prestart``).
"""

import json
import os
import socket

from runtime.forkserver_daemon import REPLY_TIMEOUT_S, SOCKET_NAME, code_version
from runtime.shim import SHIM_FILE

LOG_NAME = ".shim-server.log"
# A spare's preset longer than this is not sent (the server caps a request line).
PRESET_MAX_BYTES = 128 * 1024
DAEMON_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forkserver_daemon.py")


class ForkServerUnavailable(Exception):
    pass


class ShimLink:
    """The launcher's end of a forked shim's connection (see the module
    docstring). ``fileno`` makes it waitable with ``select``."""

    def __init__(self, sock, *, pid_namespace=None):
        self.sock, self.pending, self.ended, self.done = sock, b"", False, False
        self.pid_namespace = pid_namespace  # a spare's isolation

    def fileno(self):
        return self.sock.fileno()

    def read_reply(self):
        """The server's answer, or "" at EOF (blocking, within the reply
        timeout). A quick shim's ``done`` may come first: it is kept."""
        while True:
            while b"\n" not in self.pending:
                chunk = self.sock.recv(256)
                if not chunk:
                    self.ended = True
                    return ""
                self.pending += chunk
            line, _, self.pending = self.pending.partition(b"\n")
            if line != b"done":
                return line.decode(errors="replace").strip()
            self.done = True

    def finished(self):
        """After ``select`` said readable: True once the shim said ``done``
        or its end closed (it exited, or died)."""
        if not (self.done or self.ended or b"done\n" in self.pending):
            try:
                chunk = self.sock.recv(256)
            except ConnectionError:  # a reset is an end too
                chunk = b""
            self.pending += chunk
            self.ended = not chunk
        return self.done or self.ended or b"done\n" in self.pending

    def go(self, task_dir):
        """Hand a spare its step -> (pid, create_time | None). Raises
        ForkServerUnavailable, with nothing started, when the spare is not
        there: the caller closes the link and starts a shim the usual way."""
        try:
            parts = self.read_reply().split("\t")
            if parts[0] != "ok" or len(parts) != 3:
                raise ForkServerUnavailable(f"no spare shim: {'/'.join(parts) or 'no answer'}")
            # Only a whole line starts it: a spare that reads part of one and then EOF exits.
            self.sock.sendall(f"go\t{task_dir}\n".encode())
        except OSError as exc:
            raise ForkServerUnavailable(f"no spare shim: {exc}") from None
        self.sock.settimeout(None)
        return int(parts[1]), (float(parts[2]) if parts[2] != "-" else None)

    def close(self):
        self.sock.close()


def _connect(tasks_dir, line, **link):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(REPLY_TIMEOUT_S)
    try:
        sock.connect(os.path.join(tasks_dir, SOCKET_NAME))
        sock.sendall(line.encode() + b"\n")
    except BaseException:
        sock.close()
        raise
    return ShimLink(sock, **link)


def _request(tasks_dir, line):
    link = _connect(tasks_dir, line)
    try:
        return link.read_reply()
    finally:
        link.close()


def start_server(python, tasks_dir, idle_s):
    """Start a server (returns once it listens, or once another one holds the lock)."""
    script = DAEMON_PATH
    log = os.path.join(tasks_dir, LOG_NAME)
    pid = os.posix_spawn(
        python,
        [python, "-I", "-S", script, tasks_dir, str(idle_s)],
        {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        setsid=True,
        file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600),
            (os.POSIX_SPAWN_DUP2, 1, 2),
        ],
    )
    # The server forks once it listens and its first process exits: this
    # wait is both the readiness signal and the reaping of that process.
    os.waitpid(pid, 0)


def spawn_shim(python, tasks_dir, task_dir, *, pid_namespace, idle_s=600):
    """Ask the server to fork a shim for task_dir -> (pid, create_time | None,
    link); the caller owns the ``ShimLink`` and closes it.

    With pid_namespace the shim is forked as PID 1 of a new PID namespace.
    """
    version = code_version(python)
    isolate = "pidns" if pid_namespace else "plain"
    for attempt in range(2):
        link = None
        try:
            link = _connect(tasks_dir, f"run\t{version}\t{isolate}\t{task_dir}")
            reply = link.read_reply()
        except OSError:
            reply = ""
        parts = reply.split("\t")
        if parts[0] == "ok" and len(parts) == 3:
            link.sock.settimeout(None)  # waited on with select from here on
            return int(parts[1]), (float(parts[2]) if parts[2] != "-" else None), link
        if link is not None:
            link.close()
        started = _shim_started(task_dir)
        if started is not None:  # it runs, only its answer was lost: never start a second one
            return (*started, None)
        if attempt == 0:
            start_server(python, tasks_dir, idle_s)
    raise ForkServerUnavailable(f"no shim fork server for {tasks_dir}: {reply or 'no answer'}")


def spare_shim(python, tasks_dir, *, pid_namespace, preset=None):
    """Ask for a spare (see the module docstring) without waiting for it ->
    its ShimLink, or None when no server listens (a spare never starts one).
    ``preset``: JSON of the exec fields its step will most likely have
    (``shim_prestart.PRESET_FIELDS``), for a spare in a PID namespace to pre-start."""
    isolate = "pidns" if pid_namespace else "plain"
    line = f"spare\t{code_version(python)}\t{isolate}"
    if preset and pid_namespace and len(preset) <= PRESET_MAX_BYTES and "\n" not in preset:
        line += f"\t{preset}"
    try:
        return _connect(tasks_dir, line, pid_namespace=pid_namespace)
    except OSError:
        return None


def _shim_started(task_dir):
    """(pid, create_time) from the shim.json of a shim that has started, else None."""
    try:
        with open(os.path.join(task_dir, SHIM_FILE)) as fh:
            info = json.load(fh)
        return int(info["pid"]), info.get("create_time")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def server_pid(tasks_dir):
    """Pid of the server for tasks_dir, or None when none answers."""
    try:
        parts = _request(tasks_dir, "ping").split("\t")
    except OSError:
        return None
    return int(parts[1]) if parts[0] == "pong" else None


def stop_server(tasks_dir):
    try:
        return _request(tasks_dir, "quit") == "bye"
    except OSError:
        return False
