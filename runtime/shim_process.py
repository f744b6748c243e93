"""Process plumbing for the shim: JSON without the json package, libc calls
(unshare, setns, prctl), the forked command child (limits, credentials,
no_new_privs, the seccomp program's descriptor for bubblewrap, exec), the
process profile's hardened mounts (nosuid,nodev everywhere, a /dev of its
own), the /proc scan used when there is no PID namespace, and the host
self-test run by the capability probe.

Imported by ``runtime/shim.py`` in a bare ``python -I -S`` interpreter, so it
imports only C modules (see the start-up note in shim.py).
"""

import _json
import _signal
import errno
import os
import resource
import stat
import sys

CLONE_NEWPID = 0x20000000
CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_REC, MS_PRIVATE = 16384, 1 << 18
SIOCSIFFLAGS = 0x8914
IFF_UP, IFF_LOOPBACK, IFF_RUNNING = 0x1, 0x8, 0x40
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
CPU_HARD_GRACE_S = 1
GATE_FD = 3
# The descriptor bubblewrap reads the seccomp filter from (``--seccomp``).
SECCOMP_FD = 4
PR_SET_NO_NEW_PRIVS = 38
MAX_FD = 1 << 20  # fs.nr_open by default: no descriptor numbered higher (closed by one close_range(2))
SIG = _signal

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


# --- libc (unshare, prctl) ------------------------------------------------------

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


def loopback_up():
    """Bring up ``lo`` of a new network namespace (it starts down)."""
    import _socket  # C modules, imported before isolate() hides where they live (/root, /home)
    import _struct
    import fcntl

    sock = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        fcntl.ioctl(sock.fileno(), SIOCSIFFLAGS, _struct.pack("16sh", b"lo", IFF_UP | IFF_LOOPBACK | IFF_RUNNING))
    finally:
        sock.close()


def _private_namespaces(flags):
    """A mount namespace of our own (plus ``flags``' namespaces) from which
    nothing we mount leaks back to the host."""
    libc_call("unshare", CLONE_NEWNS | flags)
    mount(None, "/", None, MS_REC | MS_PRIVATE, None)


def _mount_own_proc():
    """/proc of our PID namespace: the step's own processes, not the host's."""
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)


def own_proc():
    """A mount namespace whose /proc is our PID namespace's: programs that
    find a child's namespaces through /proc/<pid> (pasta) see their own
    pids there, not the host's."""
    _private_namespaces(0)
    _mount_own_proc()


# mount_setattr(2) (Linux 5.12; the same number on every architecture).
SYS_MOUNT_SETATTR = 442
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x2, 0x4
# The device nodes of the process profile's own /dev (bubblewrap's --dev
# makes the same set): name -> (major, minor).
DEV_NODES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9), "tty": (5, 0)}
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2"}


def harden_mounts():
    """nosuid,nodev on every mount of our (private) mount namespace, all at
    once: no setuid program of the host gains its privileges there, and no
    device node on a host filesystem opens. Then a /dev of our own with only
    the harmless devices (the host's /dev is nodev now, like everything)."""
    libc = load_libc()
    attr = (_ctypes.c_uint64 * 4)(MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0, 0, 0)  # struct mount_attr
    if libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, attr, _ctypes.sizeof(attr)) != 0:
        err = _ctypes.get_errno()
        raise OSError(err, f"mount_setattr nosuid,nodev: {os.strerror(err)}")
    mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=65536")
    for name, (major, minor) in DEV_NODES.items():
        path = "/dev/" + name
        os.mknod(path, 0o20666, os.makedev(major, minor))  # S_IFCHR
        os.chmod(path, 0o666)  # whatever the umask
    for name, target in DEV_LINKS.items():
        os.symlink(target, "/dev/" + name)


def isolate(isolation, uid, gid, pidns):
    """The process profile's containment, made by the command's child while
    it is still root: a mount namespace where every mount is nosuid,nodev,
    with the host's non-system top-level directories, the data directory and
    the hidden paths covered, the read-only paths bound back, a sized tmpfs
    as workspace and scratch, and a network namespace with only its own
    loopback (see runtime/sandbox.py)."""
    network = isolation.get("network") or "none"
    import _socket  # noqa: F401  (loaded now: the mounts may hide the interpreter's lib-dynload)
    import _struct  # noqa: F401
    import fcntl  # noqa: F401

    _private_namespaces(0 if network == "host" else CLONE_NEWNET)
    harden_mounts()
    mounts = isolation.get("mounts") or ()
    # What is bound in comes from places the covers hide (/opt, the data
    # directory): held open from before them, bound from the descriptor.
    sources = {index: os.open(item.get("source") or item["path"], os.O_PATH | os.O_CLOEXEC)
               for index, item in enumerate(mounts) if item["kind"] in ("readonly", "hidden_file")}
    try:
        for index, item in enumerate(mounts):
            if index in sources:
                _bind_read_only(sources[index], item["path"])
                continue
            path, kind, size = item["path"], item["kind"], item.get("bytes")
            os.makedirs(path, exist_ok=True)  # inside a hidden tmpfs, for the workspace
            # A hidden path is an empty tmpfs of root's (0555): the step, no longer root, cannot write it.
            options = {"hidden": "mode=0555", "scratch": "mode=1777"}.get(kind, "mode=0700")
            if kind == "workspace" and uid is not None:
                options += f",uid={int(uid)},gid={int(gid if gid is not None else uid)}"
            if size:
                options += f",size={int(size)}"
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, options)
            if kind == "workspace" and item.get("cwd") and item["cwd"] != path:
                os.makedirs(item["cwd"], exist_ok=True)
                if uid is not None:
                    relative = os.path.relpath(item["cwd"], path)
                    parts = relative.split(os.sep)
                    for depth in range(1, len(parts) + 1):
                        os.chown(os.path.join(path, *parts[:depth]), int(uid), int(gid if gid is not None else uid))
    finally:
        for fd in sources.values():
            os.close(fd)
    if pidns:
        _mount_own_proc()
    if network != "host":
        loopback_up()


def _bind_read_only(source_fd, target):
    """Bind what ``source_fd`` (O_PATH) names at ``target``, read-only: its
    mount point made first if a cover hid it (a directory, or an empty file)."""
    if stat.S_ISDIR(os.fstat(source_fd).st_mode):
        os.makedirs(target, exist_ok=True)
    elif not os.path.lexists(target):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0))
    mount(f"/proc/self/fd/{source_fd}", target, None, MS_BIND, None)
    mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)


# --- the forked children -----------------------------------------------------


# Python starts with SIGPIPE and SIGXFSZ ignored, and ignored signals survive
# exec: without the reset a RLIMIT_FSIZE overrun gives EFBIG instead of the
# SIGXFSZ that classifies it. The others are the shim's own handlers.
CHILD_DEFAULT_SIGNALS = (SIG.SIGPIPE, SIG.SIGXFSZ, SIG.SIGXCPU, SIG.SIGTERM, SIG.SIGINT, SIG.SIGHUP, SIG.SIGUSR1,
                         SIG.SIGCHLD)
# Below this the shim itself could run out of descriptors if it carried the
# limit for a spawned command (see spawnable).
MIN_SPAWN_OPEN_FILES = 64


def reset_signals():
    for sig in CHILD_DEFAULT_SIGNALS:
        _signal.signal(sig, _signal.SIG_DFL)
    _signal.pthread_sigmask(_signal.SIG_SETMASK, [])


def spawnable(req, pidns):
    """Whether the command may be started by ``posix_spawn`` (about 0.8 ms
    cheaper than a fork of this interpreter): nothing must happen between
    fork and exec but what posix_spawn does itself (session, descriptors,
    signals) and what this throwaway process can carry for the command
    before spawning it (RLIMIT_CORE, RLIMIT_NOFILE, the working directory).
    Credentials and CPU/file-size/process/memory limits need the fork; so
    does a shim outside a PID namespace (PR_SET_PDEATHSIG)."""
    limits = req.get("limits") or {}
    if not pidns or req.get("uid") is not None or req.get("isolation") or req.get("own_proc"):
        return False
    if any(limits.get(key) for key in ("cpu_seconds", "file_size_bytes", "processes", "address_space_bytes")):
        return False
    return int(limits.get("open_files") or MIN_SPAWN_OPEN_FILES) >= MIN_SPAWN_OPEN_FILES


def spawn_command(req, stdin_fd, out_w, err_w):
    """Start the command with ``posix_spawn`` -> (pid, None), or (None,
    exec_error) when it cannot start, the same facts a forked child reports."""
    stage = "rlimit"
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        open_files = (req.get("limits") or {}).get("open_files")
        if open_files:
            resource.setrlimit(resource.RLIMIT_NOFILE, (int(open_files), int(open_files)))
        stage = "chdir"
        os.chdir(req["cwd"])
        if not req.get("sandbox_argv"):
            # On the shim itself, which from here on only supervises: the
            # spawned command inherits it (bubblewrap sets its own).
            stage = "no_new_privs"
            libc_call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        stage = "exec"
        argv = list(req.get("sandbox_argv") or []) + list(req["argv"])
        env = req.get("env") or {}
        actions = [(os.POSIX_SPAWN_DUP2, stdin_fd, 0), (os.POSIX_SPAWN_DUP2, out_w, 1),
                   (os.POSIX_SPAWN_DUP2, err_w, 2)]
        if req.get("seccomp"):
            actions.append((os.POSIX_SPAWN_OPEN, SECCOMP_FD, req["seccomp"], os.O_RDONLY, 0))
        saved = last = None
        for path in program_paths(argv[0], env):
            try:
                pid = os.posix_spawn(path, argv, env, file_actions=actions, setsid=True,
                                     setsigdef=CHILD_DEFAULT_SIGNALS, setsigmask=())
                return pid, None
            except (FileNotFoundError, NotADirectoryError) as exc:
                last = exc
            except OSError as exc:
                last = saved = saved or exc
        raise saved or last or FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), argv[0])
    except OSError as exc:
        return None, {"errno": exc.errno or 0, "stage": stage, "message": str(exc)}


def program_paths(file, env):
    """Where exec*p would look for ``file`` with ``env``'s PATH, skipping
    the places where nothing is (a stat is cheaper than a failed spawn)."""
    if os.sep in file:
        return [file]
    path = env.get("PATH")
    directories = (os.defpath if path is None else path).split(os.pathsep)
    return [candidate for directory in directories if os.path.lexists(candidate := os.path.join(directory, file))]


def exec_command(req, stdin_fd, out_w, err_w, exec_w, set_pdeathsig, gate_fd=None):
    """Child side: session, fds, limits, credentials, exec. Never returns.

    Runs in a fork of the small shim, never of the worker. RLIMIT_AS is set
    last: from there on this interpreter may not map new memory.
    ``gate_fd``: handed to the command as GATE_FD (a pre-started sandbox's
    gate, see ``shim.Prestart``).
    """
    stage = "setup"
    try:
        _signal.set_wakeup_fd(-1)
        os.setsid()
        os.dup2(stdin_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        if gate_fd is not None:
            if exec_w == GATE_FD:
                exec_w = os.dup(exec_w)  # close-on-exec still, out of the gate's way
            if gate_fd == GATE_FD:
                os.set_inheritable(GATE_FD, True)
            else:
                os.dup2(gate_fd, GATE_FD)
        keep_fds = {GATE_FD} if gate_fd is not None else set()
        if req.get("seccomp"):
            stage = "seccomp"
            if exec_w == SECCOMP_FD:
                exec_w = os.dup(exec_w)  # close-on-exec still, out of the filter's way
            open_on(req["seccomp"], SECCOMP_FD)
            keep_fds.add(SECCOMP_FD)
            stage = "setup"
        # Nothing else the shim, the fork server or whoever started them had
        # open reaches the command (exec_w closes itself at exec).
        low = 3
        for keep in sorted({exec_w, *keep_fds}):
            os.closerange(low, keep)
            low = keep + 1
        os.closerange(low, MAX_FD)
        reset_signals()
        limits = req.get("limits") or {}
        stage = "rlimit"
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        cpu = limits.get("cpu_seconds")
        if cpu:
            resource.setrlimit(resource.RLIMIT_CPU, (int(cpu), int(cpu) + CPU_HARD_GRACE_S))
        for key, rlim in (
            ("file_size_bytes", resource.RLIMIT_FSIZE),
            ("open_files", resource.RLIMIT_NOFILE),
            ("processes", resource.RLIMIT_NPROC),
        ):
            if limits.get(key):
                resource.setrlimit(rlim, (int(limits[key]), int(limits[key])))
        if req.get("isolation"):
            stage = "isolate"
            isolate(req["isolation"], req.get("uid"), req.get("gid"), pidns=not set_pdeathsig)
        elif req.get("own_proc") and not set_pdeathsig:
            stage = "isolate"
            own_proc()
        if req.get("uid") is not None:
            stage = "setuid"
            os.setgroups([])
            os.setgid(int(req["gid"]))
            os.setuid(int(req["uid"]))
        if set_pdeathsig:
            libc_call("prctl", PR_SET_PDEATHSIG, SIG.SIGKILL, 0, 0, 0)
        if not req.get("sandbox_argv"):
            # bubblewrap sets it itself (and a setuid bubblewrap could not start with it).
            stage = "no_new_privs"
            libc_call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        stage = "chdir"
        # bubblewrap changes into the workspace itself, inside its mounts.
        os.chdir("/" if req.get("sandbox_argv") else req["cwd"])
        argv = list(req.get("sandbox_argv") or []) + list(req["argv"])
        env = req.get("env") or {}
        if limits.get("address_space_bytes"):
            stage = "rlimit"
            value = int(limits["address_space_bytes"])
            resource.setrlimit(resource.RLIMIT_AS, (value, value))
        stage = "exec"
        execvpe(argv[0], argv, env)
    except BaseException as exc:
        code = getattr(exc, "errno", None) or 0
        try:
            os.write(exec_w, f"{code}\t{stage}\t{exc}".encode(errors="replace"))
        finally:
            os._exit(127)


def open_on(path, number):
    """Open ``path`` read-only as descriptor ``number``, inherited across exec."""
    fd = os.open(path, os.O_RDONLY)
    if fd == number:
        os.set_inheritable(fd, True)
    else:
        os.dup2(fd, number)
        os.close(fd)


def execvpe(file, argv, env):
    """``os.execvpe`` without its per-call ``import warnings`` (about a
    millisecond in a freshly forked child), with the same search: each
    directory of ``env``'s PATH (default path when it has none); the first
    error other than "not found" wins, else the last one."""
    if os.sep in file:
        os.execve(file, argv, env)
    path = env.get("PATH")
    saved = last = None
    for directory in (os.defpath if path is None else path).split(os.pathsep):
        try:
            os.execve(os.path.join(directory, file), argv, env)
        except (FileNotFoundError, NotADirectoryError) as exc:
            last = exc
        except OSError as exc:
            last = saved = saved or exc
    raise saved or last or FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), file)


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


def _probe_namespaces():
    """Can a child of ours get a mount and a network namespace, a tmpfs and
    a loopback in them (what the process profile's ``isolate`` does)?"""
    report = {}
    for name, flags in (("mount", CLONE_NEWNS), ("net", CLONE_NEWNET)):
        pid = os.fork()
        if pid == 0:
            try:
                libc_call("unshare", flags)
                if flags == CLONE_NEWNS:
                    mount(None, "/", None, MS_REC | MS_PRIVATE, None)
                    harden_mounts()
                    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=65536,mode=0700")
                else:
                    loopback_up()
                os._exit(0)
            except BaseException:
                os._exit(7)
        report[name] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    return report


def probe():
    """Check, in this interpreter, the mechanisms the shim relies on; print JSON."""
    report = {"euid": os.geteuid()}
    try:
        load_libc()
        report["libc"] = True
    except OSError as exc:
        report["libc"] = False
        report["libc_error"] = str(exc)
    code, error = -1, None
    if report["libc"]:  # can we fork a child that is PID 1 of its own namespace, twice?
        own = os.open("/proc/self/ns/pid", os.O_RDONLY)
        try:
            for _attempt in range(2):
                pid, isolated = fork_into_new_pid_namespace(own)
                if pid == 0:
                    os._exit(0 if os.getpid() == 1 else 3)
                code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                if not isolated:
                    error, code = "unshare(CLONE_NEWPID) refused (needs CAP_SYS_ADMIN)", -1
                    break
        except OSError as exc:
            error = str(exc)
        finally:
            os.close(own)
    report["pid_namespace"] = {"available": code == 0, "exit_code": code, "error": error}
    pid = os.fork()
    if pid == 0:  # does RLIMIT_FSIZE stop a write?
        try:
            fd = os.open("/tmp", os.O_TMPFILE | os.O_RDWR, 0o600)
            _signal.signal(SIG.SIGXFSZ, _signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1, 1))
            try:
                written = os.write(fd, b"xx")
            except OSError as exc:
                os._exit(0 if exc.errno == errno.EFBIG else 4)
            os._exit(0 if written == 1 else 5)
        except BaseException:
            os._exit(6)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    report["rlimits"] = {"enforced": code == 0, "exit_code": code}
    report["namespaces"] = _probe_namespaces() if report["libc"] else {"mount": False, "net": False}
    sys.stdout.write(dumps(report) + "\n")
    return 0
