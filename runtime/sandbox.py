"""What a contained step sees: the host paths it is shown, those hidden from
it, its own /etc/passwd, and the mounts that make that view in either
profile (``mount_plan``).

A contained step sees a minimal filesystem, not the host's:

- the system directories a command needs, read-only: ``/usr``, ``/bin``,
  ``/sbin``, ``/lib*`` (merged-/usr symlinks stay symlinks) and ``/etc``;
  nothing else of the host (``/opt``, ``/srv``, ``/var``, ``/mnt``,
  ``/home``, ``/root``, ``/run``, source checkouts, the data directory);
- in those, ``EXECGO_SANDBOX_HIDDEN_PATHS`` covered (by default the /etc
  files and directories that hold secrets: shadow files, SSH host keys,
  /etc/ssl/private, sudoers, the config of database and broker servers),
  a directory by an empty tmpfs, a file by an empty one that nobody may
  read; so is the data directory, should it lie under a visible one (one
  that a step with a uid of its own could not read anyway, /etc/shadow
  say, is left as it is: each mount costs a step time);
- ``EXECGO_SANDBOX_READONLY_PATHS``, host paths an operator adds, read-only
  (recorded in the effective plan, and rated by the policy);
- a step that runs as a uid of its own finds it named in /etc/passwd and
  /etc/group (the host's with one line more, kept in its task directory);
- its own workspace, /tmp, /var/tmp and /dev/shm as fresh tmpfs, the
  workspace and the scratch directories sized by the ``workspace_bytes``
  limit (a quota that needs no cgroups: a write past it fails with ENOSPC);
- a network namespace of its own unless the plan says ``host``.

``linux_sandbox`` builds that view with bubblewrap, on an empty root (its
command line: runtime/sandbox_argv.py). The ``process`` profile keeps the
host's root and gets the mounts from the shim itself (see
``shim_isolation.isolate``), in a mount namespace of the command's own:
every top-level directory of the host but the system ones, /proc, /dev and
/tmp is covered by an empty tmpfs (a top-level file by the unreadable empty
one), and the rest as above.

Each mount costs a step time (bubblewrap re-reads its mount table for each
one): one bind of /etc with a few covers, not a bind per entry of /etc.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping
from typing import Any

from django.conf import settings

# Small and read-only: hidden paths hold nothing and take no writes.
HIDDEN_TMPFS_BYTES = 64 * 1024
SHM_BYTES = 64 * 1024 * 1024
# The host directories a command needs, in the order bubblewrap mounts them
# (a merged-/usr host has /bin, /sbin and /lib* as symlinks into /usr).
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
# Files in /etc that a command needs and a host may keep elsewhere (a systemd
# host's resolv.conf is a link into /run): their target is bound too.
ETC_LINKS_OUT = ("/etc/resolv.conf", "/etc/localtime")
# Fresh for every step: nothing of the host's there to hide or to bind.
SCRATCH_PATHS = ("/tmp", "/var/tmp", "/dev/shm")
# Top-level entries the process profile leaves as they are, besides the
# system ones: the step's own /proc (in its PID namespace), the host's /dev,
# and /tmp (a fresh tmpfs).
PROCESS_KEEPS = frozenset({"proc", "dev", "tmp"})
# Where a host path may not be added read-only: the step's own or fresh
# there (a bind of the host's /proc would show the host's processes).
NOT_READONLY = ("/proc", "/dev", "/tmp", "/var/tmp")
# The empty file a hidden file is covered with (mode 0: nobody may read it),
# in the data directory; see hidden_file_source.
HIDDEN_FILE_NAME = "sandbox-hidden-file"
# The name of a step's own uid (and gid) in its /etc/passwd and /etc/group,
# kept in its task directory under these names.
STEP_USER = "execgo-step"
IDENTITY_FILES = {"/etc/passwd": "etc-passwd", "/etc/group": "etc-group"}


def _under(path: str, parents: Iterable[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in parents)


def system_view() -> list[dict[str, str]]:
    """What bubblewrap mounts of the host's system directories, once per
    process: ``{"path", "kind": "bind" | "symlink", "target"}`` for those
    this host has."""
    global _system
    if _system is None:
        view: list[dict[str, str]] = []
        for path in SYSTEM_PATHS:
            if os.path.islink(path):
                view.append({"path": path, "kind": "symlink", "target": os.readlink(path)})
            elif os.path.isdir(path):
                view.append({"path": path, "kind": "bind"})
        roots = [entry["path"] for entry in view if entry["kind"] == "bind"]
        for link in ETC_LINKS_OUT:
            real = os.path.realpath(link)
            if os.path.islink(link) and os.path.isfile(real) and not _under(real, roots):
                view.append({"path": real, "kind": "bind"})
        _system = view
    return _system


_system: list[dict[str, str]] | None = None


def visible_roots(readonly_paths: Iterable[str] = ()) -> list[str]:
    """The host paths a contained step sees (with what is under them):
    the system directories and the plan's read-only paths."""
    return [entry["path"] for entry in system_view() if entry["kind"] == "bind"] + list(readonly_paths)


def validate_readonly_paths(paths: Iterable[str], *, data_dir: str, tasks_dir: str) -> list[str]:
    """``EXECGO_SANDBOX_READONLY_PATHS`` as the plan records them; ValueError
    for a path that makes no sense: not absolute, not in its plain form
    (``..``, ``//``, a trailing slash), ``/`` itself, the data or tasks
    directory, under or above one of them (symlinks followed: it would show
    every step's files), or a place the step has its own (/proc, /dev, the
    scratch directories)."""
    accepted: list[str] = []
    private = [os.path.realpath(data_dir), os.path.realpath(tasks_dir)]
    for path in paths:
        if not isinstance(path, str) or not path.startswith("/"):
            raise ValueError(f"{path!r} is not an absolute path")
        if path == "/" or os.path.realpath(path) == "/":
            raise ValueError("/ would be the whole host")
        if os.path.normpath(path) != path or path.startswith("//"):
            raise ValueError(f"{path!r} is not in its plain form (no '..', '.', '//' or trailing '/')")
        real = os.path.realpath(path)
        for candidate in {path, real}:
            if _under(candidate, private) or any(_under(p, [candidate]) for p in private):
                raise ValueError(f"{path!r} would show the data directory (every step's files)")
            if _under(candidate, NOT_READONLY):
                raise ValueError(f"{path!r} is the step's own in the sandbox (/proc, /dev, /tmp, /var/tmp)")
        if path not in accepted:
            accepted.append(path)
    return accepted


def readonly_paths() -> list[str]:
    """The operator's read-only paths, checked (ValueError as above)."""
    return validate_readonly_paths(settings.EXECGO_SANDBOX_READONLY_PATHS, data_dir=str(settings.DATA_DIR),
                                   tasks_dir=str(settings.EXECGO_TASKS_DIR))


def hidden_paths() -> list[tuple[str, bool, bool]]:
    key = (str(settings.DATA_DIR), str(settings.EXECGO_TASKS_DIR), tuple(settings.EXECGO_SANDBOX_HIDDEN_PATHS))
    if key not in _hidden:
        _hidden[key] = _hidden_paths()
    return _hidden[key]


_hidden: dict[tuple, list[tuple[str, bool, bool]]] = {}


def _hidden_paths() -> list[tuple[str, bool, bool]]:
    """Host paths a contained step must not even read, parents first, each
    with whether it is a directory and whether any uid may read it (enter
    it, for a directory): the data directory (the embedded database, the
    broker folder, every other step's files, other tenants' included) and
    ``EXECGO_SANDBOX_HIDDEN_PATHS``. Symlinks are followed and paths this
    host does not have are skipped; mount_plan keeps those the step would
    otherwise see."""
    found: dict[str, tuple[bool, bool]] = {}
    for path in (settings.DATA_DIR, settings.EXECGO_TASKS_DIR, *settings.EXECGO_SANDBOX_HIDDEN_PATHS):
        real = os.path.realpath(path)
        try:
            mode = os.stat(real).st_mode
        except OSError:
            continue
        if stat.S_ISDIR(mode) or stat.S_ISREG(mode):
            others = stat.S_IXOTH if stat.S_ISDIR(mode) else stat.S_IROTH
            found[real] = (stat.S_ISDIR(mode), bool(mode & others) and _reachable(os.path.dirname(real)))
    # A path under another hidden directory is already hidden.
    ordered = sorted(found)
    return [(p, *found[p]) for p in ordered if not any(p != q and found[q][0] and _under(p, [q]) for q in ordered)]


def hidden_file_source() -> str:
    """The file a hidden file is covered with: empty, mode 0 (not even a
    step running as root may read it without capabilities), in the data
    directory, where bubblewrap (already the step's uid) finds it when every
    directory above it may be entered; else /dev/null, empty too."""
    path = os.path.join(settings.DATA_DIR, HIDDEN_FILE_NAME)
    if path not in _hidden_file:
        if not _make_hidden_file(path):
            return os.devnull  # asked again next time: the data directory may yet be opened up (secure_tasks_dir)
        _hidden_file.add(path)
    return path


_hidden_file: set[str] = set()


def _make_hidden_file(path: str) -> bool:
    try:
        info = os.lstat(path)
        if not (stat.S_ISREG(info.st_mode) and info.st_size == 0 and stat.S_IMODE(info.st_mode) == 0):
            os.unlink(path)
            raise FileNotFoundError(path)
    except FileNotFoundError:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0))
        except OSError:
            return False
    except OSError:
        return False
    return _reachable(os.path.dirname(path))


def _reachable(directory: str) -> bool:
    """Whether any uid may enter ``directory`` (bubblewrap, already the
    step's uid, must find a bind's source)."""
    parts = directory.rstrip("/").split("/")
    try:
        return all(os.stat("/".join(parts[:depth]) or "/").st_mode & stat.S_IXOTH for depth in range(1, len(parts) + 1))
    except OSError:
        return False


def identity_files(task_dir: str, *, uid: int | None, gid: int | None, home: str) -> dict[str, str]:
    """/etc/passwd and /etc/group for a step that runs as a uid of its own:
    the host's, with a name for that uid and its gid (``id -un``, ``whoami``,
    ssh and git ask for one), written in the step's task directory -> {path
    in the sandbox: file}. Empty when the step keeps the worker's uid, the
    host names it already, or the step's uid could not reach the files.
    Written once per task directory (a pre-started sandbox's preset names
    them before the step is prepared), with nothing but the host's files,
    the uid and the workspace in them."""
    if uid is None:
        return {}
    gid = uid if gid is None else gid
    host = _host_identity()
    if host is None or str(uid) in host["uids"]:
        return {}
    parent, _ = os.path.split(task_dir.rstrip("/"))
    if parent not in _reachable_dirs:
        if not _reachable(parent):
            return {}
        _reachable_dirs.add(parent)
    texts = {
        "/etc/passwd": host["/etc/passwd"] + f"{STEP_USER}:x:{uid}:{gid}:ExecGo step:{home}:/bin/sh\n",
        "/etc/group": host["/etc/group"] + f"{STEP_USER}:x:{gid}:\n",
    }
    written = {}
    for path, text in texts.items():
        target = os.path.join(task_dir, IDENTITY_FILES[path])
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            written[path] = target
            continue
        except OSError:
            return {}
        try:
            os.fchmod(fd, 0o644)  # whatever the umask: the step's uid reads it
            os.write(fd, text.encode())
        finally:
            os.close(fd)
        written[path] = target
    return written


_reachable_dirs: set[str] = set()


def _host_identity() -> dict[str, Any] | None:
    """The host's /etc/passwd and /etc/group, each ending in a newline, and
    the uids named there; read again only when either file changes."""
    global _identity
    try:
        key = tuple((info.st_mtime_ns, info.st_size, info.st_ino) for info in map(os.stat, IDENTITY_FILES))
    except OSError:
        return None
    if _identity is None or _identity[0] != key:
        texts = {}
        for path in IDENTITY_FILES:
            with open(path, errors="replace") as fh:
                text = fh.read()
            texts[path] = text if not text or text.endswith("\n") else text + "\n"
        uids = {line.split(":")[2] for line in texts["/etc/passwd"].splitlines() if line.count(":") >= 2}
        _identity = (key, {**texts, "uids": uids})
    return _identity[1]


_identity: tuple[tuple, dict[str, Any]] | None = None


def host_top_level() -> list[tuple[str, bool]]:
    """The host's top-level directories and files the process profile covers
    (all but the system ones and PROCESS_KEEPS; symlinks lead into what is
    covered or kept), once per process."""
    global _top_level
    if _top_level is None:
        keep = {path.lstrip("/") for path in SYSTEM_PATHS} | PROCESS_KEEPS
        covered = []
        for name in sorted(os.listdir("/")):
            if name in keep:
                continue
            mode = os.lstat("/" + name).st_mode
            if stat.S_ISDIR(mode) or stat.S_ISREG(mode):
                covered.append(("/" + name, stat.S_ISDIR(mode)))
        _top_level = covered
    return _top_level


_top_level: list[tuple[str, bool]] | None = None


def _cover(path: str, is_dir: bool) -> dict[str, Any]:
    if is_dir:
        return {"path": path, "kind": "hidden", "bytes": HIDDEN_TMPFS_BYTES}
    return {"path": path, "kind": "hidden_file", "source": hidden_file_source()}


def mount_plan(*, workspace: str, cwd: str, limits: Mapping[str, Any], writable_root: bool = False,
               readonly_paths: Iterable[str] = (), identity: Mapping[str, str] | None = None,
               uid: int | None = None) -> list[dict[str, Any]]:
    """The mounts of a contained step over its system view, in order, for
    either profile: each ``{"path", "kind": "hidden" | "hidden_file" |
    "readonly" | "scratch" | "workspace", ...}``. ``writable_root``: the
    step's root is the host's (the process profile), whose non-system
    top-level entries are covered first. ``readonly_paths``: the plan's.
    ``identity``: the step's /etc/passwd and /etc/group (``identity_files``),
    bound over the host's. ``uid``: the step's own (never a file's owner,
    in no group): a hidden path only its owner or group may read is out of
    its reach already, and left as it is (a mount less per step)."""
    quota = limits.get("workspace_bytes")
    readonly = [p for p in readonly_paths if os.path.lexists(p)]  # one this host lacks shows nothing
    roots = visible_roots(readonly)
    mounts: list[dict[str, Any]] = []
    if writable_root:
        mounts += [_cover(path, is_dir) for path, is_dir in host_top_level()]
    mounts += [{"path": path, "kind": "readonly"} for path in readonly]
    mounts += [{"path": path, "kind": "readonly", "source": source} for path, source in (identity or {}).items()]
    # Only what the step would see needs covering: not what lies outside its
    # view, nor under a scratch directory's fresh tmpfs (a data directory
    # under /tmp, say).
    mounts += [_cover(path, is_dir) for path, is_dir, others_may_read in hidden_paths()
               if _under(path, roots) and not _under(path, SCRATCH_PATHS) and (others_may_read or uid is None)]
    mounts += [
        {"path": "/tmp", "kind": "scratch", "bytes": quota},
        {"path": "/var/tmp", "kind": "scratch", "bytes": quota},
        {"path": "/dev/shm", "kind": "scratch", "bytes": min(quota or SHM_BYTES, SHM_BYTES)},
        {"path": workspace, "kind": "workspace", "bytes": quota, "cwd": cwd},
    ]
    return mounts
