"""Process plumbing the other shim modules share: JSON without the json
package, whole-file reads and atomic writes, a process's create time, libc
calls (unshare, setns, prctl, mount) and a fork into a new PID namespace,
a command's rusage as JSON, and the command's process tree: signalled and
killed as a whole, as PID 1 of its namespace or by a /proc scan.

Imported by ``runtime/shim.py`` in a bare ``python -I -S`` interpreter, so it
imports only C modules (see the start-up note in shim.py).
"""

import _json
import _signal
import os
import time

CLONE_NEWPID = 0x20000000
PR_SET_CHILD_SUBREAPER = 36

# --- JSON with the C accelerator only ---------------------------------------


class _ScanContext:
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = float


_scan = _json.make_scanner(_ScanContext())


def _unserializable(value):
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


_encode = _json.make_encoder(None, _unserializable, _json.encode_basestring_ascii, None, ":", ",", False, False, True)


def loads(text):
    value, end = _scan(text, 0)
    if text[end:].strip():
        raise ValueError("trailing data after JSON document")
    return value


def dumps(value):
    return "".join(_encode(value, 0))


def write_json_atomic(path, value):
    """Readers see the old file or the whole new one, never a partial write."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, dumps(value).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_file(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def process_create_time(pid):
    """When pid started, in seconds after boot (its start in clock ticks),
    as psutil's ``create_time(monotonic=True)``. Not seconds since the
    epoch: that adds the kernel's btime, which moves whenever the wall clock
    is set or slewed, and a live process would then look like another one
    that reused its pid."""
    stat = read_file(f"/proc/{pid}/stat")
    start_ticks = int(stat[stat.rfind(b")") + 2 :].split()[19])
    return start_ticks / _CLOCK_TICKS


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# --- libc (unshare, setns, prctl, mount) ----------------------------------------

_libc = None
_ctypes = None


def load_libc():
    global _libc, _ctypes
    if _libc is None:
        import ctypes  # about 3 ms: only the process-scan fallback and the fork server need it

        _ctypes = ctypes
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def libc_call(name, *args):
    libc = load_libc()
    if getattr(libc, name)(*args) != 0:
        err = _ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def fork_into_new_pid_namespace(own_namespace_fd):
    """fork() with the child as PID 1 of a new PID namespace -> (pid, isolated).

    unshare(CLONE_NEWPID) only changes where the *next* children go; setns
    back to our own namespace afterwards so the following fork can get a
    fresh namespace too. Needs CAP_SYS_ADMIN (root); without it the child is
    forked in our namespace and isolated is False.
    """
    try:
        libc_call("unshare", CLONE_NEWPID)
    except OSError:
        return os.fork(), False
    try:
        pid = os.fork()
    except BaseException:
        libc_call("setns", own_namespace_fd, CLONE_NEWPID)
        raise
    if pid:
        libc_call("setns", own_namespace_fd, CLONE_NEWPID)
    return pid, True


def mount(source, target, fstype, flags, data):
    libc = load_libc()
    args = [None if v is None else v.encode() for v in (source, target, fstype)]
    if libc.mount(args[0], args[1], args[2], flags, None if data is None else data.encode()) != 0:
        err = _ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def rusage_dict(ru):
    return {
        "utime_s": round(ru.ru_utime, 6),
        "stime_s": round(ru.ru_stime, 6),
        "maxrss_kb": ru.ru_maxrss,
        "minflt": ru.ru_minflt,
        "majflt": ru.ru_majflt,
        "inblock": ru.ru_inblock,
        "oublock": ru.ru_oublock,
        "nvcsw": ru.ru_nvcsw,
        "nivcsw": ru.ru_nivcsw,
    }


# --- process scan (fallback without a PID namespace) ----------------------------


def scan_descendants(root_pid, marker):
    """Live descendants of root_pid, plus any process carrying the marker."""
    children, found = {}, set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = read_file(f"/proc/{name}/stat")
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if fields[0] in (b"Z", b"X"):
            continue
        pid = int(name)
        children.setdefault(int(fields[1]), []).append(pid)
        if marker and pid != root_pid:
            try:
                if marker in read_file(f"/proc/{name}/environ"):
                    found.add(pid)
            except OSError:
                pass
    todo = [root_pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
            todo.append(child)
    found.discard(root_pid)
    return found


# --- the command's process tree ----------------------------------------------------


def signal_tree(sig, *, pidns, main_pid, marker):
    """Send ``sig`` to the command and everything it started."""
    if pidns:
        try:
            os.kill(-1, sig)  # from PID 1: every process of the namespace but us
        except ProcessLookupError:
            pass
        return
    targets = scan_descendants(os.getpid(), marker)
    try:
        os.killpg(main_pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in targets:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_tree(*, pidns, main_pid, marker, reap):
    """SIGKILL everything of the command's tree until ``reap`` (which reaps
    what has ended -> whether any child may be left) finds it gone -> False
    when processes were still alive 2 s later."""
    give_up = time.monotonic() + 2.0
    pause = 0.0001  # killed processes are gone in well under a millisecond, a namespace's teardown in a few
    while True:
        if pidns:
            signal_tree(_signal.SIGKILL, pidns=pidns, main_pid=main_pid, marker=marker)
            remaining = reap()  # every process of the namespace is our descendant
        else:
            targets = scan_descendants(os.getpid(), marker)
            for pid in targets:
                try:
                    os.kill(pid, _signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            remaining = reap() or bool(targets)
        if not remaining:
            return True
        if time.monotonic() > give_up:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.005)
