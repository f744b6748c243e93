"""How the shim starts a step's command: by ``posix_spawn`` when nothing
must happen between fork and exec but what posix_spawn does itself, else by
a fork of the shim whose child sets the limits, the containment and the
credentials and then execs (``exec_command``); a child that fails before
exec reports why on a pipe the parent reads (``fork_command``,
``exec_failure``).

Part of the shim: imported by a bare interpreter (``python -I -S``), so it
imports only C modules (see the start-up note in shim.py).
"""

import _signal
import errno
import os
import resource

if __package__:
    from .shim_process import libc_call
else:  # a bare interpreter: the shim's, or the fork server's
    from shim_process import libc_call

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
CPU_HARD_GRACE_S = 1
# The descriptor a pre-started sandbox's gate reads (see shim_prestart.py).
GATE_FD = 3
# The descriptor bubblewrap reads the seccomp filter from (``--seccomp``).
SECCOMP_FD = 4
MAX_FD = 1 << 20  # fs.nr_open by default: no descriptor numbered higher (closed by one close_range(2))
SIG = _signal


# --- the command's side: spawned, or the forked child that execs ------------


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
    """Child side: session, fds, limits, credentials, exec. Never returns;
    a failure is reported on ``exec_w`` with the stage it happened at.

    Runs in a fork of the small shim, never of the worker. RLIMIT_AS is set
    last: from there on this interpreter may not map new memory.
    ``gate_fd``: handed to the command as GATE_FD (a pre-started sandbox's
    gate, see ``shim_prestart.Prestart``).
    """
    stage = "setup"
    try:
        contain = _containment() if req.get("isolation") or req.get("own_proc") else None  # first: see _containment
        _signal.set_wakeup_fd(-1)
        os.setsid()
        exec_w = _std_descriptors(stdin_fd, out_w, err_w, exec_w, gate_fd)
        keep_fds = {GATE_FD} if gate_fd is not None else set()
        if req.get("seccomp"):
            stage = "seccomp"
            if exec_w == SECCOMP_FD:
                exec_w = os.dup(exec_w)  # close-on-exec still, out of the filter's way
            open_on(req["seccomp"], SECCOMP_FD)
            keep_fds.add(SECCOMP_FD)
            stage = "setup"
        _close_all_but(exec_w, *keep_fds)
        reset_signals()
        limits = req.get("limits") or {}
        stage = "rlimit"
        _set_rlimits(limits)
        if req.get("isolation"):
            stage = "isolate"
            contain.isolate(req["isolation"], req.get("uid"), req.get("gid"), pidns=not set_pdeathsig)
        elif req.get("own_proc") and not set_pdeathsig:
            stage = "isolate"
            contain.own_proc()
        if req.get("uid") is not None:
            stage = "setuid"
            _drop_privileges(req)
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


def _containment():
    """runtime/shim_isolation.py, imported on first use: only a process
    profile step with namespaces of its own needs it, and a shim started
    afresh pays for every module it imports (the fork server has it loaded
    already). Called by the forked child before it closes descriptors or
    sets limits, which an import could run into."""
    if __package__:
        from . import shim_isolation
    else:
        import shim_isolation
    return shim_isolation


def _std_descriptors(stdin_fd, out_w, err_w, exec_w, gate_fd):
    """The command's stdin, stdout and stderr, and ``gate_fd`` (if any) as its
    GATE_FD -> where ``exec_w`` is now."""
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
    return exec_w


def _close_all_but(*keep_fds):
    """Close every descriptor above stderr but ``keep_fds``: nothing else the
    shim, the fork server or whoever started them had open reaches the
    command (the failure pipe closes itself at exec)."""
    low = 3
    for keep in sorted(set(keep_fds)):
        os.closerange(low, keep)
        low = keep + 1
    os.closerange(low, MAX_FD)


def _drop_privileges(req):
    """The step's own uid and gid, and no supplementary groups."""
    os.setgroups([])
    os.setgid(int(req["gid"]))
    os.setuid(int(req["uid"]))


def _set_rlimits(limits):
    """Every limit but RLIMIT_AS, which exec_command sets last."""
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


# --- the shim's side of a fork ----------------------------------------------------


def fork_command(req, stdin_fd, out_w, err_w, parent_fds, set_pdeathsig):
    """Parent side: fork a child that runs ``exec_command`` -> (pid, the
    read end of its failure report); ``parent_fds`` are closed in the child.
    A failure before exec comes back on that pipe (see ``exec_failure``)."""
    exec_pipe, exec_w = os.pipe()
    # Blocked across fork: a SIGTERM aimed at the command before it has
    # reset its handlers stays pending instead of running ours in it.
    _signal.pthread_sigmask(_signal.SIG_BLOCK, [SIG.SIGTERM])
    pid = os.fork()
    if pid == 0:
        for fd in parent_fds:
            os.close(fd)
        exec_command(req, stdin_fd, out_w, err_w, exec_w, set_pdeathsig=set_pdeathsig)
    _signal.pthread_sigmask(_signal.SIG_UNBLOCK, [SIG.SIGTERM])
    os.close(exec_w)
    return pid, exec_pipe


def exec_failure(exec_pipe):
    """What a forked child reported before exec, or None once it exec'd;
    ``exec_pipe`` is read to its end (at exec, close-on-exec, or exit) and
    closed."""
    failure = b""
    while chunk := os.read(exec_pipe, 4096):
        failure += chunk
    os.close(exec_pipe)
    if not failure:
        return None
    code, stage, message = (failure.decode(errors="replace").split("\t", 2) + ["", ""])[:3]
    return {"errno": int(code or 0), "stage": stage, "message": message}
