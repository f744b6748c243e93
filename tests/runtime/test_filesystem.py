"""A contained step sees a minimal filesystem: the host's system directories
read-only (their secrets covered), its own workspace and scratch, the paths
an operator adds read-only, and nothing else of the host — under both
containing profiles, and in a sandbox a spare pre-started.

Canaries are world-readable files the test writes in uniquely named
directories under /opt, /srv and /var (removed afterwards); each test shows
that the same read does succeed from an uncontained step, so it can fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from django.conf import settings

from policy.baseline import baseline_reasons, plan_baseline
from runs.dataplane import rated_part, weaker_than_rated
from runtime import executor, launcher
from runtime.envelopes import EnvelopeError
from runtime.plan_resolver import resolve_plan
from runtime.sandbox import mount_plan, validate_readonly_paths
from tests.runtime.conftest import SYSTEM_PYTHON, live_processes, needs_bubblewrap, needs_system_python, wait_until

CANARY = f"CANARY_{uuid.uuid4().hex}"
PRESTARTED = "linux_sandbox, pre-started"
PROFILES = [pytest.param("linux_sandbox", marks=needs_bubblewrap()),
            pytest.param(PRESTARTED, marks=needs_bubblewrap()), "process"]
pytestmark = [
    needs_system_python(),
    pytest.mark.skipif(os.geteuid() != 0, reason="a root worker contains both profiles (and may write /opt)"),
]


def run_step(script: str, profile: str | None, *, params: dict | None = None) -> dict:
    """Run ``script`` in a default step of ``profile`` (PRESTARTED: in a spare
    that set its sandbox up ahead); the plan is resolved with the settings
    of the moment."""
    handle_id = f"t-{uuid.uuid4().hex[:16]}"
    params = {"script": script, **(params or {})}
    prestarted = profile == PRESTARTED
    plan = resolve_plan({"profile": "linux_sandbox" if prestarted else profile} if profile else {}, mode="strict")
    spare = None
    if prestarted:
        preset = launcher.sandbox_preset(handle_id, tool="shell", params=params, plan=plan)
        assert preset is not None
        spare = launcher.warm_shim(plan, preset=preset)
        # Handed over once its sandbox waits at the gate (a forecast step's spare
        # has the step before's time to get there): on a loaded machine, one
        # handed its step sooner was seen to start it the usual way instead.
        assert wait_until(lambda: any("execgo-gate" in (p.info["cmdline"] or ()) for p in live_processes(script)), 30)
    result = executor.execute(handle_id, tool="shell", params=params, timeout_s=30, attempt=1, plan=plan, spare=spare)
    assert result["details"]["termination"] == "exited", result["details"]["stderr"]
    assert (result["details"]["started_by"] == "prestart") == prestarted
    return result


def _canary_dir(parent: str) -> Path:
    directory = Path(parent) / f"execgo-canary-{uuid.uuid4().hex[:12]}"
    directory.mkdir(mode=0o755)
    os.chmod(directory, 0o755)
    (directory / "secret.env").write_text(f"{CANARY}\n")
    os.chmod(directory / "secret.env", 0o644)
    return directory


@pytest.fixture(scope="module")
def canaries():
    """World-readable files under /opt, /srv and /var (and /var/tmp, /var/lib)."""
    made = []
    try:
        for parent in ("/opt", "/srv", "/var", "/var/tmp", "/var/lib"):
            if os.path.isdir(parent):
                made.append(_canary_dir(parent))
        yield made
    finally:
        for directory in made:
            shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def readonly_dir(settings):
    """A tool directory under /opt an operator shows every step, with a
    secret in it that EXECGO_SANDBOX_HIDDEN_PATHS covers; and a sibling
    directory that is not shown."""
    shown, sibling = _canary_dir("/opt"), _canary_dir("/opt")
    (shown / "tool.txt").write_text("the operator's tool\n")
    os.chmod(shown / "tool.txt", 0o644)
    settings.EXECGO_SANDBOX_READONLY_PATHS = [str(shown)]
    settings.EXECGO_SANDBOX_HIDDEN_PATHS = [*settings.EXECGO_SANDBOX_HIDDEN_PATHS, str(shown / "secret.env")]
    try:
        yield shown, sibling
    finally:
        shutil.rmtree(shown, ignore_errors=True)
        shutil.rmtree(sibling, ignore_errors=True)


def test_the_canaries_are_readable_from_an_uncontained_step(canaries, uncontained, run_shell):
    # The reads below are real: a step the host cannot contain gets every canary.
    script = "".join(f"cat {directory}/secret.env; " for directory in canaries)
    result = run_shell({"script": script, "env": {}}, profile="process")
    assert result["output"]["stdout"].count(CANARY) == len(canaries) >= 3


@pytest.mark.parametrize("profile", PROFILES)
def test_opt_srv_and_var_of_the_host_are_not_there(canaries, profile):
    script = "".join(f"cat {directory}/secret.env; ls {directory}; " for directory in canaries)
    script += "echo ---; ls -A /var; echo ---; ls -A /opt /srv 2>&1; test -e /var/lib && echo VARLIB; true"
    result = run_step(script, profile)

    out = result["output"]["stdout"]
    assert CANARY not in out + result["details"]["stderr"]
    _, var, rest = out.split("---\n")
    assert var == "tmp\n"  # a fresh tmpfs, and nothing else of the host's /var
    assert "execgo-canary" not in rest and "VARLIB" not in rest


@pytest.mark.parametrize("profile", PROFILES)
def test_var_tmp_is_a_fresh_scratch_of_the_steps_own(canaries, profile):
    name = f"execgo-scratch-{uuid.uuid4().hex}"
    result = run_step(f"ls -A /var/tmp; echo x > /var/tmp/{name} && cat /var/tmp/{name}", profile)
    assert result["output"]["stdout"] == "x\n"
    assert not os.path.exists(f"/var/tmp/{name}")


@pytest.mark.parametrize("profile", PROFILES)
def test_etc_secrets_are_out_of_reach_while_passwd_stays(profile):
    files = [p for p in ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-", "/etc/nats-server.conf")
             if os.path.exists(p)]
    directories = [p for p in ("/etc/ssh", "/etc/ssl/private", "/etc/redis", "/etc/postgresql", "/etc/mysql",
                               "/etc/rabbitmq") if os.path.isdir(p)]
    assert files and directories  # this host has some to hide
    script = "".join(f"cat {p} && echo READ {p}; " for p in files)
    script += "".join(f"ls -A {p} | grep -q . && echo LISTED {p}; " for p in directories)
    # What others may read is covered: empty, and unreadable even so.
    script += "".join(f"test -s {p} && echo SIZED {p}; " for p in files if os.stat(p).st_mode & 0o004)
    script += "echo ---; grep -c '^root:' /etc/passwd; grep -c '^root:' /etc/group; id -un"
    result = run_step(script, profile)

    covered, names = result["output"]["stdout"].split("---\n")
    assert covered == "", covered
    assert names.split() == ["1", "1", "execgo-step"]
    assert "Permission denied" in result["details"]["stderr"]


def test_only_what_others_may_read_is_covered_for_a_uid_of_its_own(tmp_path):
    readable = [p for p in ("/etc/ssh", "/etc/postgresql", "/etc/mysql", "/etc/nats-server.conf") if os.path.exists(p)]
    private = [p for p in ("/etc/shadow", "/etc/gshadow", "/etc/redis") if os.path.exists(p)]
    assert readable and private and all(not os.stat(p).st_mode & 0o005 for p in private)
    workspace = str(tmp_path / "workspace")

    def covered(uid):
        plan = mount_plan(workspace=workspace, cwd=workspace, limits={}, uid=uid)
        return {m["path"] for m in plan if m["kind"] in ("hidden", "hidden_file")}

    assert set(readable) <= covered(1234567)
    assert not set(private) & covered(1234567)  # file modes keep it out already: a mount less each
    assert set(readable) | set(private) <= covered(None)  # the worker's own uid, which may be root


@pytest.mark.parametrize("profile", PROFILES)
def test_the_checkout_and_the_data_directory_are_not_there(profile):
    secret = Path(settings.DATA_DIR) / f"secret-{uuid.uuid4().hex}"
    secret.write_text(CANARY)
    secret.chmod(0o644)
    checkout = Path(settings.BASE_DIR)
    assert (checkout / "pyproject.toml").is_file() and (checkout / "pyproject.toml").stat().st_mode & 0o004
    try:
        result = run_step(f"cat {secret} {checkout}/pyproject.toml {checkout}/.env; ls -A {checkout}; "
                          f"ls -A {settings.DATA_DIR}", profile)
    finally:
        secret.unlink()
    out = result["output"]["stdout"]
    assert CANARY not in out and "[project]" not in out and "[tool." not in out
    listed = set(out.split())
    assert not listed & {"pyproject.toml", "manage.py", "runtime", "runs", ".git", secret.name}
    # Only the directories down to the step's own workspace.
    assert listed <= {os.path.relpath(settings.DATA_DIR, checkout).split("/")[0], "tasks"}


@pytest.mark.parametrize("profile", PROFILES)
def test_common_commands_still_work(profile):
    script = ("ls / >/dev/null && echo ls; sh -c 'echo sh'; python3 -c 'print(\"python\")'; id -un; "
              "date +%Y >/dev/null && echo date; printf 'b\\n\\303\\251\\na\\n' | LC_ALL=C.UTF-8 sort | tr '\\n' ,; "
              "echo; TZ=Europe/Paris date +%Z; head -c0 /etc/resolv.conf && echo resolv; "
              "ls /etc/ssl/certs | grep -c pem; ls -d /bin /lib /sbin /etc/alternatives; readlink /bin")
    result = run_step(script, profile)

    lines = result["output"]["stdout"].splitlines()
    assert lines[:5] == ["ls", "sh", "python", "execgo-step", "date"], result["details"]["stderr"]
    assert lines[5] == "a,b,é,"
    assert lines[6] in ("CET", "CEST")
    assert lines[7] == "resolv"
    assert int(lines[8]) > 10
    assert lines[9:13] == ["/bin", "/etc/alternatives", "/lib", "/sbin"]
    if os.path.islink("/bin"):
        assert lines[13] == os.readlink("/bin")  # a merged-/usr host's symlink, kept as one


@pytest.mark.parametrize("profile", PROFILES)
def test_a_readonly_path_is_shown_read_only_and_recorded(readonly_dir, profile):
    shown, sibling = readonly_dir
    result = run_step(f"cat {shown}/tool.txt; echo x > {shown}/new.txt; echo rc=$?; "
                      f"cat {shown}/secret.env {sibling}/secret.env; ls -A /opt", profile)

    out = result["output"]["stdout"]
    assert out.startswith("the operator's tool\nrc=")
    assert "rc=0" not in out and not (shown / "new.txt").exists()
    assert "Read-only file system" in result["details"]["stderr"] or "Permission denied" in result["details"]["stderr"]
    assert CANARY not in out  # the hidden file under it, and the sibling not shown
    assert out.split("rc=")[1].split("\n", 1)[1].split() == [shown.name]
    assert result["details"]["plan"]["readonly_paths"] == [str(shown)]


def test_the_policy_rates_a_readonly_path_medium_and_names_it(readonly_dir):
    shown, _ = readonly_dir
    plan = resolve_plan({}, mode="strict")
    assert plan["readonly_paths"] == [str(shown)]

    baseline = plan_baseline(plan, worker_is_root=True)
    assert baseline["risk"] == "medium"
    assert any(str(shown) in reason and reason.startswith("baseline medium: readonly_paths")
               for reason in baseline_reasons(baseline))
    assert rated_part(plan)["readonly_paths"] == [str(shown)]
    # A host that would show the step more than was rated (and approved) runs it weaker.
    assert weaker_than_rated(plan, {**rated_part(plan), "readonly_paths": []}) == [
        f"host paths {shown} readable, which were not rated"]
    assert weaker_than_rated(plan, rated_part(plan)) == []


def test_without_readonly_paths_the_filesystem_rates_low():
    plan = resolve_plan({}, mode="strict")
    assert plan["readonly_paths"] == []
    checks = {check["check"]: check["risk"] for check in plan_baseline(plan, worker_is_root=True)["checks"]}
    assert checks["filesystem"] == "low" and "readonly_paths" not in checks


BAD_READONLY = [
    ("opt/tools", "not an absolute path"),
    ("/", "whole host"),
    ("/opt/../etc", "plain form"),
    ("/opt/tools/", "plain form"),
    ("//opt", "plain form"),
    ("{data}", "data directory"),
    ("{data}/tasks/x", "data directory"),
    ("{data}/..", "plain form"),
    ("{parent}", "data directory"),
    ("/proc/1", "the step's own"),
    ("/dev", "the step's own"),
    ("/var/tmp/x", "the step's own"),
]


@pytest.mark.parametrize(("value", "why"), BAD_READONLY)
def test_nonsense_readonly_paths_are_refused(value, why):
    data = str(settings.DATA_DIR)
    path = value.format(data=data, parent=os.path.dirname(data))
    with pytest.raises(ValueError, match=why):
        validate_readonly_paths([path], data_dir=data, tasks_dir=str(settings.EXECGO_TASKS_DIR))


def test_a_symlink_into_the_data_directory_is_refused(tmp_path):
    link = Path("/opt") / f"execgo-link-{uuid.uuid4().hex[:12]}"
    link.symlink_to(settings.EXECGO_TASKS_DIR)
    try:
        with pytest.raises(ValueError, match="data directory"):
            validate_readonly_paths([str(link)], data_dir=str(settings.DATA_DIR),
                                    tasks_dir=str(settings.EXECGO_TASKS_DIR))
    finally:
        link.unlink()


def test_the_plan_refuses_a_nonsense_readonly_path(settings):
    settings.EXECGO_SANDBOX_READONLY_PATHS = [str(settings.EXECGO_TASKS_DIR)]
    with pytest.raises(EnvelopeError) as refused:
        resolve_plan({}, mode="adaptive")
    assert refused.value.envelope["code"] == "invalid_input"
    assert refused.value.envelope["details"]["setting"] == "EXECGO_SANDBOX_READONLY_PATHS"


@pytest.mark.parametrize("value", ["opt/tools", "/", "/opt,{data}"])
def test_settings_refuse_a_nonsense_readonly_path_at_start(value):
    env = {**os.environ, "EXECGO_SANDBOX_READONLY_PATHS": value.format(data=settings.DATA_DIR),
           "DJANGO_SETTINGS_MODULE": "execgo.settings"}
    started = subprocess.run([sys.executable, "-c", "import django; django.setup()"], env=env, capture_output=True,
                             text=True, cwd=settings.BASE_DIR, timeout=60)
    assert started.returncode != 0
    assert "ImproperlyConfigured: EXECGO_SANDBOX_READONLY_PATHS" in started.stderr


def test_settings_accept_a_plain_readonly_path():
    env = {**os.environ, "EXECGO_SANDBOX_READONLY_PATHS": "/opt/tools, /srv/models",
           "DJANGO_SETTINGS_MODULE": "execgo.settings"}
    started = subprocess.run([sys.executable, "-c", "import django; django.setup(); from django.conf import settings; "
                              "print(settings.EXECGO_SANDBOX_READONLY_PATHS)"], env=env, capture_output=True, text=True,
                             cwd=settings.BASE_DIR, timeout=60)
    assert started.stdout.strip() == "['/opt/tools', '/srv/models']", started.stderr


@pytest.mark.parametrize("profile", PROFILES)
def test_a_python_the_step_is_given_runs_from_usr(profile):
    result = run_step(f"{SYSTEM_PYTHON} -c 'import ssl, json, sqlite3; print(ssl.OPENSSL_VERSION[:7])'", profile)
    assert result["output"]["stdout"] == "OpenSSL\n", result["details"]["stderr"]
