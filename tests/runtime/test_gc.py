"""GC purges workspaces and logs of the given handles, never a running step's."""

import os

from runtime import attach, launcher, layout
from runtime.gc import purge_task_dirs
from tests.runtime.conftest import live_processes, make_plan, wait_until


def test_purge_removes_workspace_and_logs_keeps_records(run_shell, handle):
    run_shell({"script": "echo out; echo err >&2; echo '::progress 5 x'; echo data > file.txt", "stdin": "in"})
    directory = layout.task_dir(handle)
    expected = {str(directory / name) for name in ("workspace", "stdout.log", "stderr.log", "progress.jsonl", "stdin")}
    assert all(os.path.exists(path) for path in expected)
    assert set(purge_task_dirs([handle])) == expected
    assert not any(os.path.exists(path) for path in expected)
    assert (directory / "request.json").exists()
    assert attach.read_result(handle)["status"] == "success"
    assert purge_task_dirs([handle]) == []


def test_purge_skips_a_running_step(handle, marker):
    launcher.prepare(
        handle, tool="shell", params={"argv": ["sleep", f"600.{marker}"]}, timeout_s=600, attempt=1, plan=make_plan()
    )
    launcher.launch(handle)
    assert wait_until(lambda: live_processes(marker) != [])
    assert purge_task_dirs([handle]) == []
    assert (layout.task_dir(handle) / "workspace").is_dir()
    attach.cancel(handle)
    attach.wait(handle)
    assert str(layout.task_dir(handle) / "workspace") in purge_task_dirs([handle])


def test_purge_ignores_unknown_and_malicious_ids(handle):
    assert purge_task_dirs(["does-not-exist", "../../etc", "/", "", ".shim-server.sock"]) == []


def test_purge_does_not_follow_a_workspace_symlink(handle, tmp_path):
    directory = launcher.prepare(handle, tool="file", params={"op": "list"}, timeout_s=5, attempt=1, plan=make_plan())
    keep = tmp_path / "keep.txt"
    keep.write_text("precious")
    (directory / "workspace").rmdir()
    (directory / "workspace").symlink_to(tmp_path)
    assert purge_task_dirs([handle]) == [str(directory / "workspace")]
    assert keep.read_text() == "precious"
