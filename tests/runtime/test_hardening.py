"""The hardened default sandbox: every step runs with no_new_privs, a
``linux_sandbox`` step under the seccomp filter of runtime/syscall_filter.py
(fresh or pre-started), and a ``process`` step on nosuid,nodev mounts.

Each refused call is probed for real inside a step (hardening_probe.py),
with arguments that make it harmless with or without the filter; the same
probes run in the same sandbox without the filter show which errno the
kernel itself would have given, so a probe that reads EPERM only because of
the filter fails if the filter is missing.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from policy.baseline import plan_baseline
from runtime import attach, executor, forkserver, launcher, layout, syscall_filter
from runtime.capabilities import capability_manifest
from runtime.envelopes import EnvelopeError
from runtime.plan_resolver import resolve_plan
from tests.runtime.conftest import SYSTEM_PYTHON, make_plan, needs_bubblewrap, needs_pid_namespace, needs_system_python

PROBE = (Path(__file__).with_name("hardening_probe.py")).read_text()
STATUS = "grep -E '^(NoNewPrivs|Seccomp):' /proc/self/status"
# Probes the kernel refuses with EPERM even without the filter (no
# capability in the sandbox): inside, they only show the filter's word
# agrees; the other probes of their class are the ones that can fail.
EPERM_EITHER_WAY = {"mount_workspace_dir", "pivot_root_missing", "fsopen_bad_flags", "reboot_bad_magic",
                    "swapon_missing", "acct_missing", "syslog_bad_type", "settimeofday_null"}
ALLOWED = {"personality_query", "personality_default"}
pytestmark = [needs_system_python()]


def status_of(result: dict) -> dict[str, str]:
    assert result["status"] == "success", result["error"]
    return dict(line.split(":\t") for line in result["output"]["stdout"].splitlines())


def run_probes(handle: str, plan: dict) -> dict[str, int]:
    result = executor.execute(handle, tool="shell", params={"argv": [SYSTEM_PYTHON, "-c", PROBE]}, timeout_s=60,
                              attempt=1, plan=plan)
    assert result["status"] == "success", (result["error"], result["details"].get("stderr"))
    return json.loads(result["output"]["stdout"])


@needs_bubblewrap()
def test_a_default_step_has_no_new_privs_and_the_filter(run_shell, handle):
    plan = resolve_plan(None, mode="strict")
    assert (plan["profile"], plan["seccomp"], plan["downgrades"]) == ("linux_sandbox", True, [])
    result = executor.execute(handle, tool="shell", params={"script": STATUS}, timeout_s=30, attempt=1, plan=plan)
    assert status_of(result) == {"NoNewPrivs": "1", "Seccomp": "2"}


@needs_bubblewrap()
def test_every_refused_call_gets_eperm_under_the_filter_and_something_else_without(handle):
    filtered = run_probes(f"{handle}-on", make_plan("linux_sandbox"))
    unfiltered_plan = make_plan("linux_sandbox")
    unfiltered_plan["seccomp"] = False  # the same sandbox, bubblewrap without --seccomp
    unfiltered = run_probes(f"{handle}-off", unfiltered_plan)

    assert filtered.keys() == unfiltered.keys() and len(filtered) >= 45
    for name, code in filtered.items():
        if name in ALLOWED:
            assert code == unfiltered[name] == 0, name
        elif name == "clone3_null":
            # ENOSYS, so that the C library falls back to clone(), which the filter can read.
            assert (code, unfiltered[name]) == (errno.ENOSYS, errno.EINVAL)
        else:
            assert code == errno.EPERM, (name, code)
    told_apart = {name for name in filtered if name not in ALLOWED and unfiltered[name] != filtered[name]}
    assert told_apart == set(filtered) - ALLOWED - EPERM_EITHER_WAY, unfiltered
    # Each class has a probe that only the filter makes read EPERM.
    for probe in ("mount_missing_dir", "umount2_bad_flags", "chroot_missing_dir", "open_tree_bad_flags",
                  "unshare_user", "setns_bad_fd", "clone_newuser", "clone_newns", "clone_newnet", "bpf_oversized",
                  "perf_event_open_null", "userfaultfd_bad_flags", "keyctl_bad_op", "add_key_null", "ptrace_sibling",
                  "process_vm_readv_sibling", "kcmp_bad_type", "name_to_handle_at_missing",
                  "clock_settime_bad_clock", "adjtimex_null", "personality_no_aslr", "io_uring_setup_null",
                  "x32_unshare_user", "i386_unshare_user"):
        assert probe in told_apart, probe
    # Without the filter a sibling can be traced and ASLR turned off: what the filter is for.
    assert unfiltered["ptrace_sibling"] == unfiltered["personality_no_aslr"] == 0


@needs_bubblewrap()
def test_unshare_of_a_user_namespace_fails_in_a_step(run_shell):
    result = run_shell({"script": "unshare -U true; echo rc=$?"}, profile="linux_sandbox")
    assert result["output"]["stdout"] == "rc=1\n"
    assert "Operation not permitted" in result["details"]["stderr"]


@needs_bubblewrap()
@needs_pid_namespace()
def test_a_pre_started_step_gets_the_filter_too(handle):
    layout.secure_tasks_dir()
    forkserver.start_server(layout.shim_python(), str(layout.tasks_dir()), 600)
    plan = make_plan("linux_sandbox")
    params = {"argv": ["/bin/sh", "-c", STATUS]}
    preset = launcher.sandbox_preset(handle, tool="shell", params=params, plan=plan)
    assert preset is not None and json.loads(preset)["seccomp"] == syscall_filter.program_path()
    spare = launcher.warm_shim(plan, preset=preset)
    time.sleep(0.3)  # the sandbox is up, waiting at its gate
    launcher.prepare(handle, tool="shell", params=params, timeout_s=20, attempt=1, plan=plan)
    result = attach.wait(handle, launched=launcher.launch(handle, spare=spare))
    assert result["details"]["started_by"] == "prestart"
    assert status_of(result) == {"NoNewPrivs": "1", "Seccomp": "2"}


def test_the_compiled_program_is_the_workers_alone_and_comes_back_when_removed():
    path = Path(syscall_filter.program_path())
    assert path.parent == layout.tasks_dir()
    mode = path.stat().st_mode
    assert stat.S_IMODE(mode) == 0o600 and path.stat().st_uid == os.geteuid()
    program = path.read_bytes()
    assert len(program) % 8 == 0 and len(program) > 8 * len(syscall_filter.DENIED_SYSCALLS)
    path.unlink()
    assert Path(syscall_filter.program_path()) == path and path.read_bytes() == program


def test_the_probe_reports_whether_the_filter_applies(manifest):
    seccomp = manifest["seccomp"]
    assert seccomp["available"] is bool(manifest["bubblewrap"]["available"])
    if seccomp["available"]:
        assert seccomp["program"] == Path(syscall_filter.program_path()).name


def test_a_host_without_the_filter_is_refused_in_strict_mode_and_downgraded_in_adaptive():
    manifest = {**capability_manifest(), "bubblewrap": {"available": True, "path": "/usr/bin/bwrap"},
                "seccomp": {"available": False, "error": "libseccomp is not usable"}}
    with pytest.raises(EnvelopeError) as refused:
        resolve_plan(None, mode="strict", manifest=manifest)
    assert refused.value.envelope["code"] == "denied"
    assert refused.value.envelope["details"]["what"] == "seccomp"
    plan = resolve_plan(None, mode="adaptive", manifest=manifest)
    assert (plan["profile"], plan["seccomp"]) == ("linux_sandbox", False)
    assert plan["downgrades"] == [{"what": "seccomp", "requested": True, "effective": False,
                                   "reason": "the system call filter cannot be applied on this host: "
                                             "libseccomp is not usable"}]
    baseline = plan_baseline(plan, worker_is_root=False)
    profile_check = next(check for check in baseline["checks"] if check["check"] == "profile")
    assert profile_check["risk"] == "medium" and "without its system call filter" in profile_check["reason"]
    # The process profile never has it, and is rated for what it lacks.
    process = resolve_plan({"profile": "process"}, mode="adaptive", manifest=manifest)
    assert process["seccomp"] is False and not [d for d in process["downgrades"] if d["what"] == "seccomp"]


@pytest.fixture
def setuid_id():
    """A setuid-root copy of id(1) in a directory only root may write (0755),
    under /usr, which every profile shows a step; removed afterwards."""
    directory = Path(f"/usr/local/execgo-suid-{uuid.uuid4().hex[:12]}")
    directory.mkdir(mode=0o755)
    try:
        path = directory / "id"
        shutil.copy("/usr/bin/id", path)
        os.chown(path, 0, 0)
        os.chmod(path, 0o4755)
        yield str(path)
    finally:
        shutil.rmtree(directory)


@pytest.mark.skipif(os.geteuid() != 0, reason="a setuid-root binary needs a root worker to install it")
def test_a_process_step_gains_nothing_from_a_setuid_binary(run_shell, setuid_id):
    plan = make_plan("process")
    assert plan["namespaces"] and plan["uid"] not in (None, 0)
    # Outside a step, the same binary does what setuid binaries do.
    outside = subprocess.run([setuid_id, "-u"], user=plan["uid"], group=plan["uid"], extra_groups=[],
                             capture_output=True, text=True, check=True)
    assert outside.stdout == "0\n"

    result = run_shell({"script": f"{setuid_id} -u; {STATUS}; grep -c . /proc/self/mountinfo; "
                                  "grep -vc nosuid /proc/self/mountinfo; true"}, profile="process")
    assert result["status"] == "success", result["error"]
    lines = result["output"]["stdout"].splitlines()
    assert lines[0] == str(result["details"]["plan"]["uid"])  # not 0
    assert lines[1:3] == ["NoNewPrivs:\t1", "Seccomp:\t0"]
    assert int(lines[3]) > 5 and lines[4] == "0"  # every mount the step sees is nosuid


@pytest.mark.skipif(os.geteuid() != 0, reason="the process profile's own namespaces need a root worker")
def test_a_process_step_opens_no_device_of_the_host_but_the_harmless_ones(run_shell):
    script = ("head -c 4 /dev/zero | od -An -tx1; echo x > /dev/null && echo null-ok; "
              "stat -f -c %T /dev; "
              "ls /dev | tr '\\n' ' '")
    result = run_shell({"script": script}, profile="process")
    assert result["status"] == "success", result["error"]
    lines = result["output"]["stdout"].splitlines()
    assert lines[0].split() == ["00", "00", "00", "00"] and lines[1] == "null-ok"
    assert lines[2] == "tmpfs"  # a /dev of its own over the host's (nodev now)
    assert lines[3].split() == sorted(["fd", "full", "null", "random", "shm", "stderr", "stdin", "stdout", "tty",
                                       "urandom", "zero"])


def test_an_uncontained_process_step_still_has_no_new_privs(uncontained, run_shell):
    result = run_shell({"script": STATUS}, profile="process")
    assert result["details"]["plan"]["namespaces"] is False
    assert status_of(result)["NoNewPrivs"] == "1"
