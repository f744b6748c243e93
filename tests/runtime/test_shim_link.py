"""A shim forked by the fork server keeps its launcher's connection: the
server answers "ok" on it once forked, the shim says "done" once its result
is written, EOF if it dies first. A spare is forked before its step and
starts it on "go", or exits when its link closes."""

import json
import os
import signal
import socket
import sys
import time

import psutil
import pytest

from runtime import attach, forkserver, launcher, layout
from tests.runtime.conftest import kill_all, live_processes, make_plan, wait_until


def test_the_launcher_wakes_on_done_with_the_result_written(handle):
    launcher.prepare(handle, tool="shell", params={"argv": ["echo", "hi"]}, timeout_s=5, attempt=1, plan=make_plan())
    launched = launcher.launch(handle)
    assert (launched.via, launched.link is not None) == ("forkserver", True)

    result = attach.wait(handle, launched=launched)

    assert (result["status"], result["output"]["stdout"]) == ("success", "hi\n")
    assert attach.read_result(handle) == result
    assert launched.link.sock.fileno() == -1  # wait() closed it
    shim = json.loads((layout.task_dir(handle) / "shim.json").read_text())
    assert (shim["pid"], shim["create_time"]) == (launched.pid, launched.create_time)


def test_a_shim_killed_mid_step_ends_its_link_and_the_step_fails(handle, marker):
    plan = make_plan()
    launcher.prepare(handle, tool="shell", params={"argv": ["sleep", f"600.{marker}"]}, timeout_s=600, attempt=1,
                     plan=plan)
    launched = launcher.launch(handle)
    assert launched.link is not None
    assert wait_until(lambda: live_processes(marker) != [])

    os.kill(launched.pid, signal.SIGKILL)
    result = attach.wait(handle, launched=launched)

    assert result["status"] == "failed"
    assert result["error"]["code"] == "internal"
    assert "without writing result.json" in result["error"]["message"]
    if plan["tree_kill"] == "pid_namespace":  # the kernel takes the command down with its PID 1
        assert wait_until(lambda: live_processes(marker) == [], 2)
    else:
        kill_all(live_processes(marker))


def test_a_shim_that_started_is_never_started_twice(tmp_path):
    # No server answers in this tasks directory, but the shim.json of a
    # started shim is there: its answer was lost, so spawn_shim reports that
    # shim instead of starting a server and a second one.
    task_dir = tmp_path / "h-1"
    task_dir.mkdir()
    (task_dir / "shim.json").write_text(json.dumps({"pid": 4242, "create_time": 12.5, "started_at": 12.6}))

    started = forkserver.spawn_shim(sys.executable, str(tmp_path), str(task_dir), pid_namespace=False)

    assert started == (4242, 12.5, None)
    assert not (tmp_path / forkserver.SOCKET_NAME).exists()
    assert forkserver.server_pid(str(tmp_path)) is None


@pytest.fixture
def linked():
    """A ShimLink and the server's end of its connection (a socket pair)."""
    launcher, server = socket.socketpair()
    yield forkserver.ShimLink(launcher), server
    launcher.close()
    server.close()


def test_a_done_that_overtakes_the_servers_answer_is_kept(linked):
    # The server answers after fork; a quick shim's "done" can come first.
    link, server = linked
    server.sendall(b"done\nok\t4242\t12.5\n")

    assert link.read_reply() == "ok\t4242\t12.5"
    assert link.finished()


def test_a_link_is_finished_by_done_not_by_part_of_it(linked):
    link, server = linked
    server.sendall(b"ok\t4242\t12.5\n")
    assert link.read_reply() == "ok\t4242\t12.5"

    server.sendall(b"do")
    assert not link.finished()
    server.sendall(b"ne\n")
    assert link.finished()


def test_a_link_is_finished_by_its_end(linked):
    link, server = linked
    server.close()  # the shim died without a word

    assert link.finished()


def ensure_server() -> None:
    forkserver.start_server(layout.shim_python(), str(layout.tasks_dir()), 600)


def spare_pid(spare: forkserver.ShimLink) -> int:
    """The pid the server reported for a spare (reading its answer, as ``go`` does)."""
    return int(spare.read_reply().split("\t")[1])


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_spare_runs_the_step_it_is_handed(handle):
    ensure_server()
    plan = make_plan()
    spare = launcher.warm_shim(plan)
    assert spare is not None
    launcher.prepare(handle, tool="shell", params={"argv": ["echo", "spare"]}, timeout_s=5, attempt=1, plan=plan)

    launched = launcher.launch(handle, spare=spare)
    result = attach.wait(handle, launched=launched)

    assert (launched.via, launched.link) == ("spare", spare)
    assert (result["status"], result["output"]["stdout"]) == ("success", "spare\n")
    assert json.loads((layout.task_dir(handle) / "shim.json").read_text())["pid"] == launched.pid
    assert json.loads((layout.task_dir(handle) / "launch.json").read_text())["via"] == "spare"


def test_a_spare_closed_unused_exits_having_touched_nothing():
    ensure_server()
    before = sorted(layout.tasks_dir().iterdir())
    spare = launcher.warm_shim(make_plan())
    pid = spare_pid(spare)
    assert running(pid)

    spare.close()

    assert wait_until(lambda: not running(pid))
    assert sorted(layout.tasks_dir().iterdir()) == before


def test_a_spare_of_another_isolation_is_left_unused(handle):
    ensure_server()
    spare = launcher.warm_shim(make_plan(tree_kill="process_scan"))
    plan = make_plan()
    launcher.prepare(handle, tool="shell", params={"argv": ["true"]}, timeout_s=5, attempt=1, plan=plan)

    launched = launcher.launch(handle, spare=spare)
    result = attach.wait(handle, launched=launched)

    assert result["status"] == "success"
    if plan["tree_kill"] == "pid_namespace":
        assert launched.via == "forkserver"
        assert spare.sock.fileno() == -1  # launch closed it: the spare exits


def test_no_spare_without_a_server(tmp_path, settings):
    settings.EXECGO_TASKS_DIR = str(tmp_path)

    assert launcher.warm_shim(make_plan()) is None
    assert not (tmp_path / forkserver.SOCKET_NAME).exists()


def test_a_server_of_a_deleted_tasks_directory_leaves_its_successor_alone(tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    forkserver.start_server(sys.executable, str(tasks), 60)
    first = forkserver.server_pid(str(tasks))
    moved = tmp_path / "old-tasks"
    tasks.rename(moved)  # its files go along; the path it bound is free again
    tasks.mkdir()
    forkserver.start_server(sys.executable, str(tasks), 60)
    second = forkserver.server_pid(str(tasks))
    try:
        assert first and second and first != second
        # The first one ends (as at its idle timeout): the path it bound is now the successor's socket.
        assert forkserver.stop_server(str(moved))
        deadline = time.monotonic() + 10
        while _alive(first):
            assert time.monotonic() < deadline, "the first server did not exit"
            time.sleep(0.05)
        assert forkserver.server_pid(str(tasks)) == second
    finally:
        forkserver.stop_server(str(tasks))


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
