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


def load_json(path: Path) -> dict[str, Any] | None:
    """The file's JSON, or None when it is missing or still being written."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def write_json_atomic(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)
