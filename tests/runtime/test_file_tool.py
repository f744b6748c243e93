"""The file tool stays inside the workspace."""

import os

import pytest

from runtime import executor, launcher, layout
from tests.runtime.conftest import make_plan


def run_file(handle_id, params):
    return executor.execute(handle_id, tool="file", params=params, timeout_s=5, attempt=1, plan=make_plan())


def workspace_of(handle_id):
    return layout.task_dir(handle_id) / "workspace"


def test_write_creates_parents_and_each_handle_has_its_own_workspace(handle):
    written = run_file(handle, {"op": "write", "path": "notes/a.txt", "content": "héllo"})
    assert written["status"] == "success"
    assert written["output"] == {"path": "notes/a.txt", "bytes_written": 6}
    assert (workspace_of(handle) / "notes" / "a.txt").read_text() == "héllo"
    read = executor.execute(
        f"{handle}-r", tool="file", params={"op": "read", "path": "x"}, timeout_s=5, attempt=1, plan=make_plan()
    )
    assert read["error"]["code"] == "not_found"


def test_read_and_list_in_the_same_workspace(handle):
    from runtime.tools import file as file_tool

    directory = launcher.prepare(handle, tool="file", params={"op": "list"}, timeout_s=5, attempt=1, plan=make_plan())
    workspace = directory / "workspace"
    (workspace / "d").mkdir()
    (workspace / "d" / "f.txt").write_text("content")
    output, details = file_tool.run({"op": "read", "path": "d/f.txt"}, workspace=workspace)
    assert output == {"path": "d/f.txt", "content": "content", "size": 7}
    output, _ = file_tool.run({"op": "list", "path": "d"}, workspace=workspace)
    assert output["entries"] == [{"name": "f.txt", "type": "file", "size": 7}]


@pytest.mark.parametrize("path", ["../request.json", "a/../../request.json", "/etc/passwd", "../../../../etc/passwd"])
def test_traversal_is_denied(handle, path):
    result = run_file(handle, {"op": "read", "path": path})
    assert result["status"] == "failed"
    assert result["error"]["code"] == "denied"


def test_write_through_traversal_is_denied_and_writes_nothing(handle):
    result = run_file(handle, {"op": "write", "path": "../escape.txt", "content": "x"})
    assert result["error"]["code"] == "denied"
    assert not (layout.task_dir(handle) / "escape.txt").exists()


@pytest.mark.parametrize("op", ["read", "write", "list"])
def test_symlink_escape_is_denied(handle, op, tmp_path):
    from runtime.envelopes import EnvelopeError
    from runtime.tools import file as file_tool

    directory = launcher.prepare(handle, tool="file", params={"op": "list"}, timeout_s=5, attempt=1, plan=make_plan())
    workspace = directory / "workspace"
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    os.symlink(secret, workspace / "link.txt")
    os.symlink(tmp_path, workspace / "linkdir")
    params = {
        "read": {"op": "read", "path": "link.txt"},
        "write": {"op": "write", "path": "linkdir/new.txt", "content": "x"},
        "list": {"op": "list", "path": "linkdir"},
    }[op]
    with pytest.raises(EnvelopeError) as refused:
        file_tool.run(params, workspace=workspace)
    assert refused.value.code == "denied"
    assert secret.read_text() == "top secret"
    assert not (tmp_path / "new.txt").exists()


def test_symlink_inside_the_workspace_is_followed(handle):
    from runtime.tools import file as file_tool

    directory = launcher.prepare(handle, tool="file", params={"op": "list"}, timeout_s=5, attempt=1, plan=make_plan())
    workspace = directory / "workspace"
    (workspace / "real.txt").write_text("data")
    os.symlink("real.txt", workspace / "alias.txt")
    output, _ = file_tool.run({"op": "read", "path": "alias.txt"}, workspace=workspace)
    assert output["content"] == "data"


@pytest.mark.parametrize(
    "params",
    [
        {"op": "delete", "path": "a"},
        {"op": "write", "path": "a"},
        {"op": "read", "path": ""},
        {"op": "read", "path": "a", "content": "x"},
        {"op": "read", "path": "a\x00b"},
        {"op": "read"},
    ],
)
def test_bad_params_are_invalid_input(handle, params):
    result = run_file(handle, params)
    assert result["error"]["code"] == "invalid_input"
