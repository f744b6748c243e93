"""A spare shim told its step ahead sets up that step's sandbox before the
step is known for sure (``runtime.shim_prestart.Prestart``): the command then runs
only on the gate's "go", which the shim writes only for a request that is
exactly the preset. A spare closed unused, killed, or handed another step
never runs the pre-started command, and a pre-started step is the step a
fresh start would have run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import psutil
import pytest

from runtime import attach, forkserver, launcher, layout, shim_prestart
from tests.runtime.conftest import (
    SYSTEM_PYTHON,
    kill_all,
    live_processes,
    make_plan,
    needs_bubblewrap,
    needs_pid_namespace,
    needs_system_python,
    wait_until,
)

pytestmark = [needs_bubblewrap(), needs_pid_namespace()]

# What a command can tell of how it was started.
SELF_REPORT = (
    "import json, os\n"
    "fds = []\n"
    "for fd in range(64):\n"
    "    try:\n"
    "        os.fstat(fd)\n"
    "        fds.append(fd)\n"
    "    except OSError:\n"
    "        pass\n"
    "status = dict(line.split(':', 1) for line in open('/proc/self/status'))\n"
    "print(json.dumps({'ids': [os.getuid(), os.geteuid(), os.getgid()], 'groups': os.getgroups(),\n"
    "                  'cwd': os.getcwd(), 'env': dict(os.environ), 'fds': fds, 'pid': os.getpid(),\n"
    "                  'ppid': os.getppid(), 'sid': os.getsid(0) == os.getpid(),\n"
    "                  'caps': status['CapEff'].strip(), 'nonewprivs': status['NoNewPrivs'].strip(),\n"
    "                  'limits': open('/proc/self/limits').read(), 'workspace': os.listdir('.'),\n"
    "                  'mounts': sorted(line.split()[4] for line in open('/proc/self/mountinfo'))}))\n"
)


@pytest.fixture
def server():
    layout.secure_tasks_dir()
    forkserver.start_server(layout.shim_python(), str(layout.tasks_dir()), 600)


def warm(handle: str, params: dict, plan: dict) -> forkserver.ShimLink:
    preset = launcher.sandbox_preset(handle, tool="shell", params=params, plan=plan)
    assert preset is not None
    spare = launcher.warm_shim(plan, preset=preset)
    assert spare is not None
    return spare


def run(handle: str, params: dict, plan: dict, spare: forkserver.ShimLink | None) -> dict:
    launcher.prepare(handle, tool="shell", params=params, timeout_s=20, attempt=1, plan=plan)
    return attach.wait(handle, launched=launcher.launch(handle, spare=spare))


def gate_of(marker: str) -> list[psutil.Process]:
    """The pre-started sandbox's processes waiting at the gate for the command naming marker."""
    return [p for p in live_processes(marker) if "execgo-gate" in (p.info["cmdline"] or ())]


def commands_of(marker: str) -> list[psutil.Process]:
    """The command itself (``sleep 600.<marker>``), if it ever started."""
    return [p for p in live_processes(marker) if (p.info["cmdline"] or [""])[0] == "sleep"]


def never_started(marker: str, for_s: float = 1.0) -> bool:
    deadline = time.monotonic() + for_s
    while time.monotonic() < deadline:
        if commands_of(marker):
            return False
        time.sleep(0.01)
    return True


@needs_system_python()
def test_a_pre_started_step_is_the_step_a_fresh_start_runs(server, handle):
    plan = make_plan("linux_sandbox")
    params = {"argv": [SYSTEM_PYTHON, "-c", SELF_REPORT], "cwd": "sub/dir", "env": {"STEP_NOTE": "a b\nc"}}
    reports = {}
    for mode in ("prestart", "fork"):
        step = f"{handle}-{mode}"
        if mode == "prestart":
            spare = warm(step, params, plan)
            time.sleep(0.3)  # the sandbox is up, waiting at its gate
        else:
            spare = launcher.warm_shim(plan)
        result = run(step, params, plan, spare)
        assert result["status"] == "success", result["error"]
        assert result["details"]["started_by"] == mode
        reports[mode] = json.loads(result["output"]["stdout"].replace(step, "<handle>"))

    fresh = reports["fork"]
    assert fresh["ids"] == [plan["uid"]] * 3 and fresh["fds"] == [0, 1, 2]
    assert fresh["cwd"] == str(layout.tasks_dir() / "<handle>" / "workspace" / "sub" / "dir")
    assert reports["prestart"] == fresh  # env, descriptors (no gate), ids, limits, mounts, cwd, session


@pytest.mark.parametrize("written, runs", [(b"", False), (b"nogo\n", False), (b"go", False), (b"go\ngo\n", True),
                                           (b"go\n", True)])
def test_the_gate_execs_the_command_only_on_go(tmp_path, written, runs):
    flag = tmp_path / "ran"
    read_end, write_end = os.pipe()
    gate = subprocess.Popen(["/bin/sh", "-c", 'exec "$@" 3<&0 0</dev/null', "to-fd-3", *shim_prestart.GATE_ARGV,
                             "/bin/sh", "-c", 'test -e /proc/self/fd/3 && echo "fd 3 open"; touch "$1"', "cmd", flag],
                            stdin=read_end, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    os.close(read_end)
    if written:
        os.write(write_end, written)
    os.close(write_end)
    out, err = gate.communicate(timeout=10)

    assert flag.exists() == runs, err
    assert (gate.returncode == 0) == runs
    assert out == b""  # the command does not get the gate's descriptor


def test_a_spare_closed_unused_never_runs_its_pre_started_command(server, handle, marker):
    plan = make_plan("linux_sandbox")
    spare = warm(handle, {"argv": ["sleep", f"600.{marker}"]}, plan)
    assert wait_until(lambda: gate_of(marker) != [], 10)

    spare.close()

    assert never_started(marker)
    assert wait_until(lambda: live_processes(marker) == [], 5)
    # Only what the preset named was written (the step's /etc/passwd): no shim ever ran for the handle.
    assert sorted(p.name for p in layout.task_dir(handle).iterdir()) == ["etc-group", "etc-passwd"]


def test_a_spare_killed_never_runs_its_pre_started_command(server, handle, marker):
    plan = make_plan("linux_sandbox")
    spare = warm(handle, {"argv": ["sleep", f"600.{marker}"]}, plan)
    spare_pid = int(spare.read_reply().split("\t")[1])
    assert wait_until(lambda: gate_of(marker) != [], 10)

    os.kill(spare_pid, signal.SIGKILL)  # its gate sees end of file (and the kernel kills its namespace)

    assert never_started(marker)
    assert wait_until(lambda: live_processes(marker) == [], 5)
    spare.close()


def test_a_step_other_than_the_preset_starts_the_usual_way(server, handle, marker):
    plan = make_plan("linux_sandbox")
    spare = warm(handle, {"argv": ["sleep", f"600.{marker}"]}, plan)
    assert wait_until(lambda: gate_of(marker) != [], 10)

    result = run(handle, {"argv": ["echo", "the step handed over"]}, plan, spare)

    assert (result["status"], result["output"]["stdout"]) == ("success", "the step handed over\n")
    assert result["details"]["started_by"] == "fork"
    assert never_started(marker, 0.2)
    assert live_processes(marker) == []


def test_the_same_command_with_another_uid_is_another_step(server, handle, marker):
    plan = make_plan("linux_sandbox")
    spare = warm(handle, {"argv": ["sleep", f"0.{marker}"]}, plan)
    other = {**plan, "uid": plan["uid"] + 1, "gid": plan["gid"] + 1}

    result = run(handle, {"argv": ["sleep", f"0.{marker}"]}, other, spare)

    assert result["status"] == "success"
    assert result["details"]["started_by"] == "fork"
    assert result["details"]["plan"]["uid"] == other["uid"]


def test_a_pre_started_sandbox_that_died_is_replaced(server, handle, marker):
    plan = make_plan("linux_sandbox")
    params = {"argv": ["echo", f"ok {marker}"]}
    spare = warm(handle, params, plan)
    assert wait_until(lambda: gate_of(marker) != [], 10)
    kill_all(gate_of(marker))
    # Died: bubblewrap, its child gone, has ended too. (Handed its step in
    # the moment between the two, the shim would open a gate nobody reads.)
    assert wait_until(lambda: live_processes(marker) == [], 10)

    result = run(handle, params, plan, spare)

    assert (result["status"], result["output"]["stdout"]) == ("success", f"ok {marker}\n")
    assert result["details"]["started_by"] == "fork"


def test_a_pre_started_step_still_has_its_timeout_and_limits(server, handle):
    plan = make_plan("linux_sandbox", {"processes": 64})
    params = {"argv": ["sleep", "30"]}
    spare = warm(handle, params, plan)
    time.sleep(0.3)
    launcher.prepare(handle, tool="shell", params=params, timeout_s=0.5, attempt=1, plan=plan)

    result = attach.wait(handle, launched=launcher.launch(handle, spare=spare))

    assert result["details"]["started_by"] == "prestart"
    assert result["error"]["code"] == "timeout"
    assert result["details"]["plan"]["limits"]["processes"] == 64


@pytest.mark.parametrize("case", ["stdin", "process profile", "a shell variable", "no such program",
                                  "a relative program", "a program under /tmp", "a relative PATH entry"])
def test_what_the_gate_would_not_start_as_is_gets_no_preset(settings, handle, tmp_path, case):
    plan = make_plan("linux_sandbox")
    params: dict = {"argv": ["true"]}
    assert launcher.sandbox_preset(handle, tool="shell", params=params, plan=plan) is not None
    if case == "stdin":
        params["stdin"] = "input"
    elif case == "process profile":
        plan = make_plan("process")
    elif case == "a shell variable":
        settings.EXECGO_SHELL_ENV_ALLOWLIST = [*settings.EXECGO_SHELL_ENV_ALLOWLIST, "IFS"]
        params["env"] = {"IFS": ","}
    elif case == "no such program":
        params["argv"] = ["no-such-program-anywhere"]
    elif case == "a relative program":
        params["argv"] = ["./run.sh"]
    elif case == "a program under /tmp":  # the step's /tmp is a fresh tmpfs: it would not find it
        program = tmp_path / "prog"
        program.write_text("#!/bin/sh\n")
        program.chmod(0o755)
        params["argv"] = [str(program)]
    elif case == "a relative PATH entry":
        settings.EXECGO_SHELL_PATH = f"bin:{settings.EXECGO_SHELL_PATH}"

    assert launcher.sandbox_preset(handle, tool="shell", params=params, plan=plan) is None
