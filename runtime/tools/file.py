"""The ``file`` tool: read, write or list inside the step's workspace.

Params: ``{"op": "read" | "write" | "list", "path": "relative/path", "content": "…"}``
(``content`` for write only). Paths are relative to the workspace. Anything
that would leave it is refused with ``denied``: absolute paths, ``..``
components, and symlinks resolving outside (a symlink that stays inside is
followed). After the realpath check the path is opened component by
component with O_NOFOLLOW from a descriptor of the workspace, so a
directory swapped for a symlink between check and use is refused too.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from django.conf import settings

from runtime.envelopes import EnvelopeError

OPS = ("read", "write", "list")
MAX_LIST_ENTRIES = 1000


def max_bytes() -> int:
    return settings.EXECGO_FILE_MAX_BYTES


def _invalid(message: str, **details: Any) -> EnvelopeError:
    return EnvelopeError.of("invalid_input", message, source="executor", details=details)


def _denied(message: str, path: str) -> EnvelopeError:
    return EnvelopeError.of("denied", message, source="executor", details={"path": path})


def relative_parts(path: str) -> tuple[str, ...]:
    """The components of a workspace-relative path; raises denied if it leaves the workspace."""
    if "\x00" in path:
        raise _invalid("path contains a NUL byte")
    pure = PurePosixPath(path)
    if pure.is_absolute():
        raise _denied("absolute paths are outside the workspace", path)
    if ".." in pure.parts:
        raise _denied("path traversal ('..') is not allowed", path)
    return tuple(part for part in pure.parts if part != ".")


def validate_params(params: Any) -> None:
    if not isinstance(params, dict):
        raise _invalid("file params must be an object")
    unknown = sorted(set(params) - {"op", "path", "content"})
    if unknown:
        raise _invalid(f"unknown file params: {', '.join(unknown)}", unknown=unknown)
    op = params.get("op")
    if op not in OPS:
        raise _invalid(f"op must be one of {', '.join(OPS)}", op=op)
    path = params.get("path", "." if op == "list" else None)
    if not isinstance(path, str) or not path:
        raise _invalid("path must be a non-empty string")
    if not relative_parts(path) and op != "list":
        raise _invalid("path names the workspace itself", path=path)
    if op == "write":
        content = params.get("content")
        if not isinstance(content, str):
            raise _invalid("write needs content (a string)")
        if len(content.encode()) > max_bytes():
            raise _invalid(f"content is larger than {max_bytes()} bytes")
    elif "content" in params:
        raise _invalid(f"content is only accepted by write, not {op}")


def _inside(workspace: str, path: str) -> tuple[str, ...]:
    """Components of the real (symlink-free) path, checked to stay in the workspace."""
    parts = relative_parts(path)
    real = os.path.realpath(os.path.join(workspace, *parts))
    if real != workspace and os.path.commonpath([workspace, real]) != workspace:
        raise _denied("path resolves outside the workspace (symlink escape)", path)
    rel = os.path.relpath(real, workspace)
    return () if rel == "." else tuple(rel.split(os.sep))


def _open_dir(root_fd: int, parts: tuple[str, ...], path: str, *, create: bool, owner: tuple[int, int] | None) -> int:
    fd = os.dup(root_fd)
    try:
        for part in parts:
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    if owner:
                        os.chown(part, *owner, dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    pass
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                raise EnvelopeError.of("not_found", f"no such directory: {path}", details={"path": path}) from None
            except (NotADirectoryError, OSError) as exc:
                if isinstance(exc, NotADirectoryError) or exc.errno == errno.ELOOP:  # a symlink appeared
                    raise _denied("path is not a plain directory inside the workspace", path) from None
                raise
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def run(params: dict[str, Any], *, workspace: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Do the operation -> (output, details); raises EnvelopeError."""
    validate_params(params)
    op, path = params["op"], params.get("path", ".")
    root = os.path.realpath(workspace)
    parts = _inside(root, path)
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        root_stat = os.fstat(root_fd)
        owner = (root_stat.st_uid, root_stat.st_gid) if os.geteuid() == 0 else None
        if op == "list":
            return _list(root_fd, parts, path)
        dir_fd = _open_dir(root_fd, parts[:-1], path, create=(op == "write"), owner=owner)
        try:
            if op == "read":
                return _read(dir_fd, parts[-1], path)
            return _write(dir_fd, parts[-1], path, params["content"], owner)
        finally:
            os.close(dir_fd)
    finally:
        os.close(root_fd)


def _open_leaf(dir_fd: int, name: str, path: str, flags: int, mode: int = 0o644) -> int:
    try:
        return os.open(name, flags | os.O_NOFOLLOW, mode, dir_fd=dir_fd)
    except FileNotFoundError:
        raise EnvelopeError.of("not_found", f"no such file: {path}", details={"path": path}) from None
    except IsADirectoryError:
        raise _invalid(f"{path} is a directory", path=path) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the leaf became a symlink after the check
            raise _denied("path is a symlink", path) from None
        raise


def _read(dir_fd: int, name: str, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    fd = _open_leaf(dir_fd, name, path, os.O_RDONLY)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _invalid(f"{path} is not a regular file", path=path)
        data = os.read(fd, max_bytes() + 1)
    finally:
        os.close(fd)
    truncated = len(data) > max_bytes()
    data = data[: max_bytes()]
    output = {"path": path, "content": data.decode(errors="replace"), "size": info.st_size}
    return output, {"path": path, "size": info.st_size, "truncated": truncated}


def _write(
    dir_fd: int, name: str, path: str, content: str, owner: tuple[int, int] | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    data = content.encode()
    fd = _open_leaf(dir_fd, name, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _invalid(f"{path} is not a regular file", path=path)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if owner:
            os.fchown(fd, *owner)  # later shell steps may run as the workspace's (dropped) owner
    finally:
        os.close(fd)
    return {"path": path, "bytes_written": len(data)}, {"path": path, "size": len(data)}


def _list(root_fd: int, parts: tuple[str, ...], path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    fd = _open_dir(root_fd, parts, path, create=False, owner=None)
    entries = []
    try:
        with os.scandir(fd) as it:
            for entry in it:
                if entry.is_symlink():
                    kind, size = "symlink", None
                elif entry.is_dir(follow_symlinks=False):
                    kind, size = "dir", None
                elif entry.is_file(follow_symlinks=False):
                    kind, size = "file", entry.stat(follow_symlinks=False).st_size
                else:
                    kind, size = "other", None
                entries.append({"name": entry.name, "type": kind, "size": size})
    finally:
        os.close(fd)
    entries.sort(key=lambda e: e["name"])
    truncated = len(entries) > MAX_LIST_ENTRIES
    return (
        {"path": path, "entries": entries[:MAX_LIST_ENTRIES]},
        {"path": path, "size": len(entries), "truncated": truncated},
    )
