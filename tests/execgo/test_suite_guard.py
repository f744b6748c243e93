"""What the suite cleans up after its tests (tests/conftest.py): a test
that ends with a run still going fails (``celery_worker``: the shared
worker outlives the test, and its next writes would meet the flush after
it), and the shim fork servers a killed worker left behind are stopped
with the suite; a test process that dies fails the pass instead of
hanging it."""

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from runs.statemachine import RunState
from runtime import forkserver
from tests.conftest import ROOT, fail_on_runs_in_flight, stop_fork_servers_under

S = RunState


@pytest.mark.django_db
@pytest.mark.parametrize("state", [S.CREATED, S.EXECUTING, S.TRACING])
def test_a_run_still_going_fails_the_test_and_is_named(make_run, state):
    run = make_run(state)
    with pytest.raises(pytest.fail.Exception, match=rf"runs in flight \(run, state\): \[\({run.pk}, '{state}'\)\]"):
        fail_on_runs_in_flight(grace_s=0.2)


@pytest.mark.django_db
def test_runs_that_ended_or_wait_for_a_person_pass(make_run):
    for state in (S.SUCCEEDED, S.CLOSED_FAILED, S.CLOSED_CANCELLED, S.CLOSED_REJECTED, S.AWAITING_HITL):
        make_run(state)
    fail_on_runs_in_flight(grace_s=0.2)


def test_the_fork_servers_under_the_data_directory_are_stopped():
    # A directory of its own, with a short path: a Unix socket's path has at most 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="fs-"))
    servers = []
    try:
        for host in ("gw0", "gw1/api"):
            tasks = root / host / "tasks"
            tasks.mkdir(parents=True)
            forkserver.start_server(sys.executable, str(tasks), 60)
            pid = forkserver.server_pid(str(tasks))
            assert pid is not None, f"no fork server answers in {tasks}"
            servers.append(psutil.Process(pid))
        stop_fork_servers_under(root)
        _gone, alive = psutil.wait_procs(servers, timeout=10)
        assert alive == []
    finally:
        for server in servers:
            if server.is_running():
                server.kill()
        shutil.rmtree(root, ignore_errors=True)


def test_a_test_process_that_dies_fails_its_test_and_is_not_replaced(tmp_path):
    (tmp_path / "test_dies.py").write_text(
        "import os, signal\n\n\ndef test_dies():\n    os.kill(os.getpid(), signal.SIGKILL)\n\n\n"
        "def test_lives():\n    pass\n")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
         "-p", "no:django", "-n", "2", "test_dies.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    # One process went down, and no replacement ran its tests again. (The
    # summary's lines are as wide as the terminal, or whole where CI is set.)
    assert result.stdout.count("node down") == 1, result.stdout
    assert re.search(r"^FAILED test_dies\.py::test_dies - worker 'gw\d' crashed while running", result.stdout,
                     re.MULTILINE), result.stdout
    assert "crashed and worker restarting disabled" in result.stdout, result.stdout
