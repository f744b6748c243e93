"""How the shim starts the command: ``posix_spawn`` when the plan asks for
nothing that must run between fork and exec, a fork of the shim otherwise.
The command finds the same world either way, and a command that cannot
start is reported the same way."""

import pytest

from runtime.shim_exec import CHILD_DEFAULT_SIGNALS, spawnable
from tests.runtime.conftest import needs_pid_namespace

# The shell is the command itself; the `awk` it starts inherits what it
# inherited (ignored and blocked signals) and reports the shell's session.
PROBE = (
    "pwd; ulimit -n; ulimit -c; "
    "grep -E '^Sig(Ign|Blk):' /proc/self/status; "
    "awk '{print ($4 == $6) ? \"session leader\" : \"not a session leader\"}' /proc/self/stat; "
    "echo \"$HOME\" | grep -q workspace && echo home"
)


def signal_mask(line: str) -> set[int]:
    """The signals of a ``/proc/<pid>/status`` mask line (``SigIgn:\t<hex>``)."""
    bits = int(line.split()[1], 16)
    return {number for number in range(1, 65) if bits >> (number - 1) & 1}


@needs_pid_namespace()
@pytest.mark.parametrize("limits, started_by", [
    ({"open_files": 256}, "posix_spawn"),
    ({"open_files": 256, "cpu_seconds": 60}, "fork"),
    ({"open_files": 256, "file_size_bytes": 10**9}, "fork"),
    ({"open_files": 256, "address_space_bytes": 1 << 33}, "fork"),
])
def test_the_command_starts_in_the_same_state_either_way(run_shell, limits, started_by, uncontained):
    result = run_shell({"script": PROBE, "cwd": "sub/dir"}, limits=limits)

    assert result["status"] == "success", result
    assert result["details"]["started_by"] == started_by
    lines = result["output"]["stdout"].splitlines()
    assert lines[0].endswith("/workspace/sub/dir")
    assert lines[1:3] == ["256", "0"]
    blocked, ignored = signal_mask(lines[3]), signal_mask(lines[4])  # /proc lists SigBlk, then SigIgn
    assert blocked == set()
    assert not ignored & set(CHILD_DEFAULT_SIGNALS)  # SIGPIPE, SIGXFSZ … at their default, not ignored
    assert lines[5:] == ["session leader", "home"]


@needs_pid_namespace()
@pytest.mark.parametrize("limits", [{}, {"cpu_seconds": 60}], ids=["posix_spawn", "fork"])
@pytest.mark.parametrize("argv, code", [
    (["definitely-not-a-program-xyz"], "not_found"),
    (["/tmp"], "denied"),  # there, but not executable
    (["./no/such/path"], "not_found"),
])
def test_a_command_that_cannot_start_is_reported_alike(run_shell, limits, argv, code, uncontained):
    result = run_shell({"argv": argv}, limits=limits)

    assert result["status"] == "failed"
    assert result["details"]["termination"] == "exec_failed"
    assert result["details"]["exec_error"]["stage"] == "exec"
    assert result["error"]["code"] == code


@needs_pid_namespace()
def test_a_missing_working_directory_is_a_chdir_failure_on_the_spawn_path(run_shell, handle, uncontained):
    from runtime import attach, launcher

    # prepare() creates the cwd; take it away again before the shim starts.
    directory = launcher.prepare(handle, tool="shell", params={"argv": ["true"], "cwd": "gone"}, timeout_s=30,
                                 attempt=1, plan={"profile": "process"})
    (directory / "workspace" / "gone").rmdir()
    launcher.launch(handle)
    result = attach.wait(handle)

    assert result["details"]["started_by"] == "posix_spawn"
    assert result["details"]["termination"] == "exec_failed"
    assert result["details"]["exec_error"]["stage"] == "chdir"
    assert result["error"]["code"] == "not_found"


def test_spawn_only_where_nothing_needs_the_fork():
    plain = {"limits": {"open_files": 1024, "log_cap_bytes": 1 << 20}, "uid": None}
    assert spawnable(plain, pidns=True)
    assert not spawnable(plain, pidns=False)  # PR_SET_PDEATHSIG needs the fork
    assert not spawnable({**plain, "uid": 65534}, pidns=True)
    for limit in ("cpu_seconds", "file_size_bytes", "processes", "address_space_bytes"):
        assert not spawnable({**plain, "limits": {**plain["limits"], limit: 1}}, pidns=True)
    # The shim carries RLIMIT_NOFILE for a spawned command: not one it could not live with.
    assert not spawnable({**plain, "limits": {"open_files": 16}}, pidns=True)
