"""The process profile's containment (``isolate``), made by the shim's
forked command child while it is still root: namespaces of the command's
own, every mount nosuid,nodev, a /dev of its own, the covers, binds and
sized tmpfs of the step's mount plan (runtime/sandbox.py), and a loopback
that is up. The capability probe (shim_probe.py) tries the same pieces.

Part of the shim: imported by a bare interpreter (``python -I -S``), so it
imports only C modules (see the start-up note in shim.py).
"""

import os
import stat

if __package__:
    from .shim_process import libc_call, load_libc, mount
else:  # a bare interpreter: the shim's, or the fork server's
    from shim_process import libc_call, load_libc, mount

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_REC, MS_PRIVATE = 16384, 1 << 18
SIOCSIFFLAGS = 0x8914
IFF_UP, IFF_LOOPBACK, IFF_RUNNING = 0x1, 0x8, 0x40


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
    import ctypes  # loaded by load_libc already: a look-up in sys.modules

    attr = (ctypes.c_uint64 * 4)(MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0, 0, 0)  # struct mount_attr
    if libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, attr, ctypes.sizeof(attr)) != 0:
        err = ctypes.get_errno()
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
