"""Purge the bulky part of finished steps: workspaces and logs.

The caller (the harness) decides which of this host's handles
(``handles_with_artifacts``) belong to final runs past their retention;
this module only finds and deletes files. ``request.json``,
``result.json`` and the small bookkeeping files stay, so a result can still
be read back after its logs are gone; Run, Trace and AuditLog rows live in
the database and are never touched here. A handle whose shim is still
running (no result yet) is skipped, whatever the caller says.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from runtime import shim
from runtime.attach import shim_alive
from runtime.envelopes import EnvelopeError
from runtime.layout import WORKSPACE_DIR, task_dir, tasks_dir

PURGED_FILES = (shim.STDOUT_FILE, shim.STDERR_FILE, shim.PROGRESS_FILE, shim.STDIN_FILE, shim.SHIM_ERR_FILE)
PURGED = frozenset((WORKSPACE_DIR, *PURGED_FILES))


def handles_with_artifacts() -> list[str]:
    """The names of this host's task directories that still hold a
    workspace or a log: what ``purge_task_dirs`` has left to delete (one
    directory listing each; a purged directory keeps only small files)."""
    found = []
    try:
        entries = os.scandir(tasks_dir())
    except FileNotFoundError:
        return found
    with entries:
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False) and not PURGED.isdisjoint(os.listdir(entry.path)):
                    found.append(entry.name)
            except OSError:
                continue  # gone meanwhile, or not ours to read
    return found


def _remove(path: Path) -> bool:
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink()
        else:
            shutil.rmtree(path)  # rmtree never follows symlinks out of the tree
    except FileNotFoundError:
        return False
    return True


def purge_task_dirs(handle_ids: Iterable[str]) -> list[str]:
    """Delete workspaces and logs of the given handles; returns the paths removed."""
    removed: list[str] = []
    for handle_id in handle_ids:
        try:
            directory = task_dir(handle_id)
        except EnvelopeError:
            continue  # not a handle id: never build a path from it
        if not directory.is_dir():
            continue
        if not (directory / shim.RESULT_FILE).exists() and shim_alive(handle_id):
            continue  # still running (a shim that wrote its result is only exiting: its step's processes are gone)
        for name in (WORKSPACE_DIR, *PURGED_FILES):
            path = directory / name
            if os.path.lexists(path) and _remove(path):
                removed.append(str(path))
    return removed
