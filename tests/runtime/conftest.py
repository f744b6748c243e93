"""Fixtures for the runtime (data plane) tests: real shims, real processes."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

from runtime import executor, layout
from runtime.capabilities import capability_manifest
from runtime.plan_resolver import resolve_plan

# A Python the sandbox uid can execute (the project's virtualenv may live
# under /root, which uid 65534 cannot enter).
SYSTEM_PYTHON = "/usr/bin/python3"
MIB = 1024 * 1024
# Every process forks for as long as it can, and keeps trying.
FORK_BOMB = (
    "import os, time\n"
    "while True:\n"
    "    try:\n"
    "        os.fork()\n"
    "    except OSError:\n"
    "        time.sleep(0.01)\n"
)


@pytest.fixture(scope="session")
def manifest() -> dict[str, Any]:
    return capability_manifest()


@pytest.fixture
def handle() -> Iterator[str]:
    """A fresh handle id; its task directories (``<id>``, ``<id>-*``) are removed afterwards."""
    handle_id = f"t-{uuid.uuid4().hex[:16]}"
    yield handle_id
    for directory in layout.tasks_dir().glob(f"{handle_id}*"):
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def marker() -> str:
    """A number unique to the test, usable in argv (e.g. ``sleep 600.<marker>``)."""
    return str(uuid.uuid4().int % 10**9).zfill(9)


def needs_system_python():
    return pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason=f"{SYSTEM_PYTHON} missing")


def needs_bubblewrap():
    available = capability_manifest()["bubblewrap"]["available"]
    return pytest.mark.skipif(not available, reason="the capability probe says bubblewrap is unusable here")


def needs_pid_namespace():
    available = capability_manifest()["pid_namespace"]["available"]
    return pytest.mark.skipif(not available, reason="the capability probe says PID namespaces are unusable here")


def make_plan(profile: str = "process", limits: dict | None = None, *, tree_kill: str | None = None,
              network: str | None = None) -> dict:
    plan = resolve_plan({"profile": profile, "limits": limits or {}}, mode=PLAN_MODE["mode"])
    if tree_kill is not None:
        plan["tree_kill"] = tree_kill
    if network is not None:  # "host": what an adaptive downgrade gives; for tests that must reach the host
        plan["network"] = network
    return plan


PLAN_MODE = {"mode": "strict"}
NO_LIMITS = {"cpu_seconds": None, "address_space_bytes": None, "file_size_bytes": None, "open_files": 1024,
             "processes": None, "workspace_bytes": None, "log_cap_bytes": 8 * MIB}


@pytest.fixture
def uncontained(settings, monkeypatch):
    """The process profile as a worker that cannot contain gets it: the
    worker's uid, the host's mounts and network, no default limits; for
    tests of the shim's mechanics (the posix_spawn path, host paths)."""
    settings.EXECGO_SANDBOX_UID = None
    settings.EXECGO_DEFAULT_LIMITS = dict(NO_LIMITS)
    settings.EXECGO_LIMIT_CAPS = dict.fromkeys(NO_LIMITS)
    real = capability_manifest()
    monkeypatch.setattr("runtime.plan_resolver.capability_manifest",
                        lambda: {**real, "namespaces": {"mount": False, "net": False}})
    monkeypatch.setitem(PLAN_MODE, "mode", "adaptive")  # it downgrades to the host's network


@pytest.fixture
def run_shell(handle) -> Callable[..., dict]:
    """Run a shell step to its end -> the envelope (handle: the fixture's)."""

    def run(
        params: dict,
        *,
        timeout_s: float = 30,
        profile: str = "process",
        limits: dict | None = None,
        tree_kill: str | None = None,
        handle_id: str | None = None,
        network: str | None = None,
        **kwargs: Any,
    ) -> dict:
        return executor.execute(
            handle_id or handle,
            tool="shell",
            params=params,
            timeout_s=timeout_s,
            attempt=1,
            plan=make_plan(profile, limits, tree_kill=tree_kill, network=network),
            **kwargs,
        )

    return run


def kill_all(processes: list[psutil.Process]) -> None:
    """SIGKILL each process; one already gone (killing a sandbox's first process
    takes the rest of its PID namespace with it) is no error."""
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def live_processes(marker: str) -> list[psutil.Process]:
    """Processes (not zombies) whose command line or environment mentions marker."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        if process.info["status"] == psutil.STATUS_ZOMBIE or process.pid == os.getpid():
            continue
        try:
            in_cmdline = any(marker in part for part in process.info["cmdline"] or ())
            in_environ = in_cmdline or any(marker in value for value in process.environ().values())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if in_cmdline or in_environ:
            found.append(process)
    return found


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()
