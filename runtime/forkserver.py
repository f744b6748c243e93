"""Fork server for shims: the fast way to start one.

A fresh ``python -I -S shim.py`` costs 7-10 ms of interpreter start-up per
step. This server is that interpreter started once (per tasks directory),
with the shim and ctypes already imported; for each step it forks a copy
(well under a millisecond for a ~15 MB process) that runs ``shim.main``,
as PID 1 of a fresh PID namespace when the plan asks for one.

- It lives in its own session, detached from whichever worker started it,
  so neither a worker's death nor the server's own death touches running
  shims (they never had the worker as parent, and a shim does not depend on
  the server once forked). SIGCHLD is ignored, so finished shims are reaped
  by the kernel and never linger as zombies.
- One server per tasks directory: an exclusive flock on ``.shim-server.lock``
  is held for its lifetime, the Unix socket is created 0600 and peers are
  checked with SO_PEERCRED, because whoever can talk to it runs commands as
  its user.
- It exits after ``idle_s`` without requests, and on the first request made
  with another code version (shim sources or interpreter changed), so a
  deploy never keeps running stale shim code.

Clients (``runtime.launcher``) call ``spawn_shim``; on any failure they start
the shim directly instead, so the server is an optimisation, never a
dependency. Server side: ``python -I -S runtime/forkserver.py <tasks_dir>
<idle_s>``.

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
step that ended. A spare whose link closes (or that waits ``SPARE_WAIT_S``)
exits without running anything. A spare asked for with a *preset* (the
exec fields of the request its step will most likely have) also starts
that step's sandbox at once and holds it at a gate (``shim.Prestart``).
"""

import _signal
import fcntl
import os
import socket
import struct
import sys

SOCKET_NAME = ".shim-server.sock"
LOCK_NAME = ".shim-server.lock"
LOG_NAME = ".shim-server.log"
REPLY_TIMEOUT_S = 2.0
SPARE_WAIT_S = 60.0
# A request line's cap; a spare's preset longer than PRESET_MAX_BYTES is not sent.
MAX_LINE_BYTES = 256 * 1024
PRESET_MAX_BYTES = 128 * 1024
SOURCES = ("shim.py", "shim_process.py", "forkserver.py")


class ForkServerUnavailable(Exception):
    pass


def code_version(python):
    here = os.path.dirname(os.path.abspath(__file__))
    stamps = [str(os.stat(os.path.join(here, name)).st_mtime_ns) for name in SOURCES]
    return "/".join([os.path.realpath(python), *stamps])


# --- client -----------------------------------------------------------------------


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
    script = os.path.abspath(__file__)
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
    (``shim.PRESET_FIELDS``), for a spare in a PID namespace to pre-start."""
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
    # Client side only: the server itself stays a bare interpreter that
    # imports neither json nor the runtime package.
    import json

    from runtime.shim import SHIM_FILE

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


# --- server ------------------------------------------------------------------------


def _fork_shim(shim, task_dir, isolate, own_namespace_fd, listener, conn, lock_fd, preset=""):
    """Fork the shim; it keeps ``conn``, its link to the launcher. A spare
    (``task_dir`` None) first pre-starts its ``preset``, if any, then waits
    on it for its step."""
    if isolate:
        pid, _isolated = shim.proc.fork_into_new_pid_namespace(own_namespace_fd)
    else:
        pid = os.fork()
    if pid:
        return pid
    code = 70
    try:
        listener.close()
        os.close(lock_fd)
        os.close(own_namespace_fd)
        os.setsid()
        _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)
        prestarted = None
        if task_dir is None:
            prestarted = shim.Prestart.start(preset) if preset else None
            task_dir = _await_go(conn)
        if task_dir:
            code = shim.main(task_dir, forked=True, link=conn, prestarted=prestarted)
        else:
            if prestarted is not None:
                prestarted.discard()
            code = 0
    finally:
        os._exit(code)


def _await_go(conn):
    """A spare's step: the task directory of ``go <task_dir>``, or None when
    the link closes (or stays silent for SPARE_WAIT_S) before a whole line."""
    conn.settimeout(SPARE_WAIT_S)
    received = b""
    try:
        while b"\n" not in received:
            chunk = conn.recv(4096)
            if not chunk:
                return None
            received += chunk
    except OSError:
        return None
    conn.settimeout(REPLY_TIMEOUT_S)
    command, _, task_dir = received.partition(b"\n")[0].decode(errors="replace").partition("\t")
    return task_dir if command == "go" and task_dir else None


def _read_line(conn):
    """One request line (a spare's may be longer than one read); what
    follows it on the connection, if anything, is lost."""
    received = b""
    while b"\n" not in received:
        chunk = conn.recv(65536)
        if not chunk:
            break
        received += chunk
        if len(received) > MAX_LINE_BYTES:
            raise OSError("request line too long")
    return received.partition(b"\n")[0].decode()


def serve(tasks_dir, idle_s):
    lock_fd = os.open(os.path.join(tasks_dir, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another server owns this tasks directory
    path = os.path.join(tasks_dir, SOCKET_NAME)
    try:
        os.unlink(path)  # stale: its owner released the lock
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old_umask)
    bound = os.stat(path)
    listener.listen(128)
    if os.fork():
        os._exit(0)  # tells the starter we listen; the child keeps lock and socket
    os.chdir("/")

    # The server runs as a bare script: the shim is imported from beside it,
    # once, so every forked shim starts with it loaded.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import shim

    shim.proc.load_libc()
    own_namespace_fd = os.open("/proc/self/ns/pid", os.O_RDONLY)
    version = code_version(sys.executable)
    _signal.signal(_signal.SIGCHLD, _signal.SIG_IGN)
    listener.settimeout(idle_s)
    me = os.geteuid()
    try:
        while True:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                break
            with conn:
                conn.settimeout(REPLY_TIMEOUT_S)
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                _pid, uid, _gid = struct.unpack("3i", creds)
                if uid not in (me, 0):
                    continue
                try:
                    line = _read_line(conn)
                except (OSError, UnicodeDecodeError):
                    continue
                command, _, rest = line.partition("\t")
                if command == "quit":
                    conn.sendall(b"bye\n")
                    break
                if command == "ping":
                    conn.sendall(f"pong\t{os.getpid()}\t{version}\n".encode())
                    continue
                if command not in ("run", "spare"):
                    conn.sendall(b"error\tunknown command\n")
                    continue
                client_version, _, rest = rest.partition("\t")
                isolate, _, task_dir = rest.partition("\t")  # a spare's preset, for a spare
                if client_version != version:
                    conn.sendall(b"stale\n")
                    break
                if command == "run" and not os.path.isfile(os.path.join(task_dir, shim.REQUEST_FILE)):
                    conn.sendall(b"error\tno request.json\n")
                    continue
                try:
                    pid = _fork_shim(shim, task_dir if command == "run" else None, isolate == "pidns",
                                     own_namespace_fd, listener, conn, lock_fd,
                                     preset=task_dir if command == "spare" else "")
                except OSError as exc:
                    conn.sendall(f"error\tfork failed: {exc}\n".encode())
                    continue
                try:
                    created = repr(shim.proc.process_create_time(pid))
                except (OSError, ValueError, IndexError):
                    created = "-"
                conn.sendall(f"ok\t{pid}\t{created}\n".encode())  # the shim keeps conn and says "done" on it
    finally:
        # Unlink before releasing the lock: a successor binds only under the
        # lock. And only our own socket: if the tasks directory was deleted and
        # made anew meanwhile, this path is a successor's.
        try:
            current = os.stat(path)
            if (current.st_dev, current.st_ino) == (bound.st_dev, bound.st_ino):
                os.unlink(path)
        except FileNotFoundError:
            pass
        listener.close()
        os.close(lock_fd)
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], float(sys.argv[2])))
