"""The shim fork server itself (see runtime/forkserver.py for what it is for
and how a launcher talks to it).

Run as ``python -I -S runtime/forkserver_daemon.py <tasks_dir> <idle_s>``
(``forkserver.start_server``): a bare interpreter that imports neither
Django nor the runtime package, only the shim's modules from beside it.

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

Requests, one line each, tab-separated: ``ping``, ``quit``, ``run <version>
<isolate> <task_dir>`` and ``spare <version> <isolate> [<preset>]``. A
spare waits on its connection for ``go <task_dir>`` (or exits when the link
closes, or after SPARE_WAIT_S), having first pre-started its preset's
sandbox if it was given one (runtime/shim_prestart.py).
"""

import _signal
import fcntl
import os
import socket
import struct
import sys

SOCKET_NAME = ".shim-server.sock"
LOCK_NAME = ".shim-server.lock"
REPLY_TIMEOUT_S = 2.0
SPARE_WAIT_S = 60.0
# A request line's cap (a spare's carries its preset).
MAX_LINE_BYTES = 256 * 1024
# What the server runs, and the client that talks to it: a change to any of
# them makes a running server stale.
SOURCES = ("forkserver.py", "forkserver_daemon.py", "shim.py", "shim_exec.py", "shim_isolation.py", "shim_outcome.py",
           "shim_prestart.py", "shim_process.py")


def code_version(python):
    here = os.path.dirname(os.path.abspath(__file__))
    stamps = [str(os.stat(os.path.join(here, name)).st_mtime_ns) for name in SOURCES]
    return "/".join([os.path.realpath(python), *stamps])


def serve(tasks_dir, idle_s):
    lock_fd = os.open(os.path.join(tasks_dir, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another server owns this tasks directory
    path = os.path.join(tasks_dir, SOCKET_NAME)
    listener, bound = _listen(path)
    if os.fork():
        os._exit(0)  # tells the starter we listen; the child keeps lock and socket
    os.chdir("/")

    # The server runs as a bare script: the shim is imported from beside it,
    # once, so every forked shim starts with it loaded (with the modules a
    # shim started afresh imports only when its step needs them).
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import shim
    import shim_isolation  # noqa: F401
    import shim_prestart

    shim.proc.load_libc()
    server = _Server(listener, lock_fd, shim, shim_prestart)
    _signal.signal(_signal.SIGCHLD, _signal.SIG_IGN)
    listener.settimeout(idle_s)
    try:
        while True:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                break
            with conn:
                if not server.answer(conn):
                    break
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


def _listen(path):
    """A listening socket at ``path``, 0600 -> (it, the stat of what was bound)."""
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
    return listener, bound


class _Server:
    """The forking server's state: what every forked shim must close, and
    the shim's modules it forks with."""

    def __init__(self, listener, lock_fd, shim, shim_prestart):
        self.listener, self.lock_fd = listener, lock_fd
        self.shim, self.shim_prestart = shim, shim_prestart
        self.own_namespace_fd = os.open("/proc/self/ns/pid", os.O_RDONLY)
        self.version = code_version(sys.executable)
        self.me = os.geteuid()

    def answer(self, conn):
        """Answer one request -> False when the server is to stop (``quit``,
        or a client of another code version)."""
        conn.settimeout(REPLY_TIMEOUT_S)
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        if uid not in (self.me, 0):
            return True
        try:
            line = _read_line(conn)
        except (OSError, UnicodeDecodeError):
            return True
        command, _, rest = line.partition("\t")
        if command == "quit":
            conn.sendall(b"bye\n")
            return False
        if command == "ping":
            conn.sendall(f"pong\t{os.getpid()}\t{self.version}\n".encode())
            return True
        if command not in ("run", "spare"):
            conn.sendall(b"error\tunknown command\n")
            return True
        client_version, _, rest = rest.partition("\t")
        isolate, _, task_dir = rest.partition("\t")  # a spare's preset, for a spare
        if client_version != self.version:
            conn.sendall(b"stale\n")
            return False
        if command == "run" and not os.path.isfile(os.path.join(task_dir, self.shim.REQUEST_FILE)):
            conn.sendall(b"error\tno request.json\n")
            return True
        try:
            pid = self.fork_shim(task_dir if command == "run" else None, isolate == "pidns", conn,
                                 preset=task_dir if command == "spare" else "")
        except OSError as exc:
            conn.sendall(f"error\tfork failed: {exc}\n".encode())
            return True
        try:
            created = repr(self.shim.proc.process_create_time(pid))
        except (OSError, ValueError, IndexError):
            created = "-"
        conn.sendall(f"ok\t{pid}\t{created}\n".encode())  # the shim keeps conn and says "done" on it
        return True

    def fork_shim(self, task_dir, isolate, conn, preset=""):
        """Fork the shim; it keeps ``conn``, its link to the launcher. A spare
        (``task_dir`` None) first pre-starts its ``preset``, if any, then waits
        on it for its step."""
        if isolate:
            pid, _isolated = self.shim.proc.fork_into_new_pid_namespace(self.own_namespace_fd)
        else:
            pid = os.fork()
        if pid:
            return pid
        code = 70
        try:
            self.listener.close()
            os.close(self.lock_fd)
            os.close(self.own_namespace_fd)
            os.setsid()
            _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)
            prestarted = None
            if task_dir is None:
                prestarted = self.shim_prestart.Prestart.start(preset) if preset else None
                task_dir = _await_go(conn)
            if task_dir:
                code = self.shim.main(task_dir, forked=True, link=conn, prestarted=prestarted)
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


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], float(sys.argv[2])))
