"""Where the data plane keeps things: each step's task directory and its
files, and the shim program that runs there.

Layout of one step (``EXECGO_TASKS_DIR/<handle_id>/``)::

    request.json    what to run (written by ``launcher.prepare``)
    launch.json     shim pid + create time; created exclusively by the one
                    launch of this handle (empty until the shim is started)
    shim.json       the same, written by the shim itself once it runs
    stdout.log, stderr.log, progress.jsonl, shim.err, stdin, cancel
    result.json     the shim's facts (shell) or the envelope (http, file)
    workspace/      the command's working directory
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from django.conf import settings

from runtime import shim
from runtime.envelopes import EnvelopeError

HANDLE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
LAUNCH_FILE = "launch.json"
WORKSPACE_DIR = "workspace"
SHIM_PATH = str(Path(shim.__file__).resolve())


def tasks_dir() -> Path:
    return Path(settings.EXECGO_TASKS_DIR)


def task_dir(handle_id: str) -> Path:
    if not isinstance(handle_id, str) or not HANDLE_ID.match(handle_id):
        raise EnvelopeError.of("invalid_input", f"bad handle id {handle_id!r}", details={"pattern": HANDLE_ID.pattern})
    return tasks_dir() / handle_id


def shim_python() -> str:
    return settings.EXECGO_SHIM_PYTHON


def shim_command(*args: str) -> list[str]:
    return [shim_python(), "-I", "-S", SHIM_PATH, *args]


_secured: set[str] = set()


def secure_tasks_dir() -> None:
    """File modes that keep a step that is not in a mount namespace of its
    own (the uncontained process profile) out of the data directory: the
    data and tasks directories can be entered but not listed (0711), and
    what sits directly in the data directory (the SQLite files, the broker
    folder) is the worker's alone. Once per process and directory."""
    key = str(tasks_dir())
    if key in _secured:
        return
    data_dir = Path(settings.DATA_DIR)
    tasks_dir().mkdir(parents=True, exist_ok=True)
    for directory in {data_dir, tasks_dir()}:
        _chmod(directory, 0o711)
    for entry in data_dir.iterdir():
        if entry.name in ("static",) or entry == tasks_dir():
            continue  # collected static files are public
        try:
            mode = entry.lstat().st_mode
        except FileNotFoundError:
            continue
        if not entry.is_symlink() and mode & 0o077:
            _chmod(entry, mode & 0o700)
    _secured.add(key)


def _chmod(path: Path, mode: int) -> None:
    try:
        os.chmod(path, mode)
    except PermissionError:  # not ours: the operator set it up
        pass


def write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def load_json(path: Path) -> dict[str, Any] | None:
    """The file's JSON, or None when it is missing or still being written."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def write_json_atomic(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    write_private(tmp, json.dumps(value).encode())
    os.replace(tmp, path)
