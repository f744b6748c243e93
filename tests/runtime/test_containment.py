"""Contained by default: a shell step of one tenant tries to reach another
tenant's step, the data directory, the host's services and the worker, and
gets nothing, under both containing profiles: ``linux_sandbox`` (bubblewrap)
and ``process`` (what a root worker without bubblewrap gives: the step's
own uid, file modes, and the shim's mount and network namespaces).

Every attempt is harmless if it succeeds: reads, ``kill -0``, connections
that send nothing, and writes of new, uniquely named files that the test
looks for on the host afterwards.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest
from django.conf import settings

from runtime import attach, executor, forkserver, launcher, layout
from runtime.plan_resolver import resolve_plan
from tests.runtime.conftest import FORK_BOMB, SYSTEM_PYTHON, needs_bubblewrap, needs_system_python, wait_until

SECRET = f"SECRET_A_{uuid.uuid4().hex}"
pytestmark = [
    needs_system_python(),
    pytest.mark.skipif(os.geteuid() != 0, reason="containment by uid is what a root worker does"),
]
PROFILES = [pytest.param("linux_sandbox", marks=needs_bubblewrap()), "process"]
# ... and a chain's next step, whose bubblewrap sandbox a spare set up ahead (runtime.shim_prestart.Prestart).
PRESTARTED = "linux_sandbox, pre-started"


def connect(host: str, port: int, family: str = "AF_INET") -> str:
    return (f"{SYSTEM_PYTHON} -c \"import socket; s = socket.socket(socket.{family}); s.settimeout(2); "
            f"s.connect(('{host}', {port})); print('ESCAPED')\"")


def connect_unix(path: str) -> str:
    return (f"{SYSTEM_PYTHON} -c \"import socket; s = socket.socket(socket.AF_UNIX); s.settimeout(2); "
            f"s.connect('{path}'); print('ESCAPED')\"")


def read(path: str) -> str:
    return f"grep -rh {SECRET} {path} && echo ESCAPED"


def host_address() -> str | None:
    """One of this host's own non-loopback addresses."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    return None


@pytest.fixture(scope="module")
def victim():
    """Tenant A's step: a finished one (its files as the worker leaves them)
    and a running one holding the secret in its environment."""
    handle_id = f"t-victim-{uuid.uuid4().hex[:12]}"
    plan = resolve_plan({"profile": "process"}, mode="adaptive")
    directory, _ = launcher.prepare_request(handle_id, tool="shell", params={"argv": ["true"], "stdin": SECRET},
                                            timeout_s=30, attempt=1, plan=plan)
    for name in ("stdout.log", "stderr.log", "result.json"):
        layout.write_private(directory / name, f"{SECRET}\n".encode())
    (directory / "workspace" / "notes.txt").write_text(f"{SECRET}\n")
    # A descriptor of the secret left open (inheritable) by whoever started
    # the worker: the fork server started next inherits it, as would a shim.
    forkserver.stop_server(str(layout.tasks_dir()))
    leaked = os.open(directory / "stdout.log", os.O_RDONLY)
    os.set_inheritable(leaked, True)
    live_id = f"{handle_id}-live"
    launcher.prepare(live_id, tool="shell", params={"argv": ["sleep", "120"], "env": {"STEP_SECRET": SECRET}},
                     timeout_s=120, attempt=1, plan=plan)
    launcher.launch(live_id)
    assert wait_until(lambda: any(p.info["cmdline"] == ["sleep", "120"] and p.uids().real == plan["uid"]
                                  for p in psutil.process_iter(["cmdline"])), 10)
    live_pid = next(p.pid for p in psutil.process_iter(["cmdline"])
                    if p.info["cmdline"] == ["sleep", "120"] and p.uids().real == plan["uid"])
    data_secret = Path(settings.DATA_DIR) / "execgo-secret.sqlite3"
    data_secret.write_text(SECRET)
    data_secret.chmod(0o644)  # as an older installation left it
    broker = Path(settings.DATA_DIR) / "broker-secret"
    broker.mkdir(exist_ok=True)
    (broker / "message.json").write_text(SECRET)
    yield {"dir": directory, "handle": handle_id, "live_pid": live_pid}
    attach.cancel(live_id)
    attach.wait(live_id)
    os.close(leaked)
    data_secret.unlink()
    (broker / "message.json").unlink()
    broker.rmdir()


@pytest.fixture(scope="module")
def web_port():
    """A stand-in for the web process (and any host service), on every address."""
    server = socket.create_server(("0.0.0.0", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
                conn.close()
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()


def attempts(victim, web_port) -> dict[str, str]:
    tasks = layout.tasks_dir()
    vdir = victim["dir"]
    pid = victim["live_pid"]
    worker = os.getpid()
    address = host_address()
    return {
        "read another step's stdout log": read(vdir / "stdout.log"),
        "read another step's stderr log": read(vdir / "stderr.log"),
        "read another step's result": read(vdir / "result.json"),
        "read another step's request and stdin": read(vdir / "stdin") + "; " + read(vdir / "request.json"),
        "read another step's workspace": read(vdir / "workspace"),
        "grep every task directory": f"grep -rh {SECRET} {tasks}/*/ 2>/dev/null | grep -q . && echo ESCAPED",
        "list the task directories": f"ls {tasks} | grep -q {victim['handle']} && echo ESCAPED",
        "read the SQLite file": read(Path(settings.DATA_DIR) / "execgo-secret.sqlite3"),
        "read the broker folder": read(Path(settings.DATA_DIR) / "broker-secret"),
        "read the worker's environment": f"grep -qa PATH= /proc/{worker}/environ && echo ESCAPED",
        "read a running step's environment": f"grep -a {SECRET} /proc/{pid}/environ && echo ESCAPED",
        "enter the worker's root": f"ls /proc/{worker}/root{settings.DATA_DIR} && echo ESCAPED",
        "the worker's environment inherited": f"env | grep -q {SECRET} && echo ESCAPED; env | grep -qE "
                                              "'^(DATABASE_URL|CELERY_BROKER_URL|REDIS_URL|DJANGO_)' && echo ESCAPED",
        "PostgreSQL over TCP": connect("127.0.0.1", 5432),
        "PostgreSQL over its unix socket": connect_unix("/var/run/postgresql/.s.PGSQL.5432"),
        "Redis over TCP": connect("127.0.0.1", 6379),
        "Redis over IPv6 loopback": connect("::1", 6379, "AF_INET6"),
        "the web port on loopback": connect("127.0.0.1", web_port),
        "the web port on the host's address": connect(address, web_port) if address else "true",
        "the shim fork server's socket": connect_unix(f"{tasks}/.shim-server.sock"),
        "read a descriptor the worker left open": f"{SYSTEM_PYTHON} -c \"import os\nfor fd in range(3, 1024):\n"
                                                  "    try: print(os.pread(fd, 4096, 0))\n    except OSError: pass\" "
                                                  f"| grep -q {SECRET} && echo ESCAPED",
        "signal the worker": f"kill -0 {worker} && echo ESCAPED",
        "signal another step": f"kill -0 {pid} && echo ESCAPED",
        "read the host's shadow file": "cat /etc/shadow >/dev/null && echo ESCAPED",
        "write into the data directory": f"echo x > {settings.DATA_DIR}/escape-{{tag}} && echo ESCAPED",
        "write into another step's directory": f"echo x > {vdir}/escape-{{tag}} && echo ESCAPED",
        "write into another step's workspace": f"echo x > {vdir}/workspace/escape-{{tag}} && echo ESCAPED",
        "write to the host's /var/tmp": "echo x > /var/tmp/escape-{tag} && echo ESCAPED",
        "write to /etc": "echo x > /etc/escape-{tag} && echo ESCAPED",
    }


WRITES = {
    "write into the data directory": lambda v, tag: Path(settings.DATA_DIR) / f"escape-{tag}",
    "write into another step's directory": lambda v, tag: v["dir"] / f"escape-{tag}",
    "write into another step's workspace": lambda v, tag: v["dir"] / "workspace" / f"escape-{tag}",
    "write to the host's /var/tmp": lambda v, tag: Path(f"/var/tmp/escape-{tag}"),
    "write to /etc": lambda v, tag: Path(f"/etc/escape-{tag}"),
}
ATTEMPTS = list(attempts({"dir": Path("/x"), "handle": "x", "live_pid": 1}, 1))


def run_default_step(script: str, profile: str | None, *, timeout_s: float = 20) -> dict:
    """Run ``script`` in a step of ``profile`` (None: the default; PRESTARTED:
    in a spare that set its sandbox up ahead, as a chain's next step is)."""
    handle_id = f"t-{uuid.uuid4().hex[:16]}"
    params = {"script": script}
    prestarted = profile == PRESTARTED
    plan = resolve_plan({"profile": "linux_sandbox" if prestarted else profile} if profile else {}, mode="strict")
    spare = None
    if prestarted:
        spare = launcher.warm_shim(plan, preset=launcher.sandbox_preset(handle_id, tool="shell", params=params,
                                                                        plan=plan))
    result = executor.execute(handle_id, tool="shell", params=params, timeout_s=timeout_s, attempt=1, plan=plan,
                              spare=spare)
    assert (result["details"]["started_by"] == "prestart") == prestarted
    return result


@pytest.mark.parametrize("profile", [*PROFILES, pytest.param(PRESTARTED, marks=needs_bubblewrap())])
@pytest.mark.parametrize("name", ATTEMPTS)
def test_an_escape_attempt_gets_nothing(victim, web_port, profile, name):
    assert len(ATTEMPTS) >= 20
    tag = uuid.uuid4().hex
    script = attempts(victim, web_port)[name].replace("{tag}", tag)
    result = run_default_step(script, profile)

    assert result["details"]["plan"]["profile"] == profile.split(",")[0]
    assert result["details"]["termination"] == "exited"  # it ran, and was refused by what it tried
    if name in WRITES:
        # A write into the step's own tmpfs (the process profile's /var/tmp) may succeed: what counts is the host.
        assert not WRITES[name](victim, tag).exists()
    else:
        assert "ESCAPED" not in result["output"]["stdout"], (name, result["details"]["stderr"])
    assert SECRET not in result["output"]["stdout"] + result["details"]["stderr"]
    assert psutil.pid_exists(victim["live_pid"])


@pytest.mark.parametrize("profile", PROFILES)
def test_the_same_probes_do_reach_the_host_from_the_host(victim, web_port, profile):
    # The attempts are real: from an uncontained process, the reads and connections succeed.
    import subprocess

    for name in ("read another step's stdout log", "PostgreSQL over TCP", "the web port on loopback"):
        out = subprocess.run(["/bin/sh", "-c", attempts(victim, web_port)[name]], capture_output=True, text=True)
        assert "ESCAPED" in out.stdout, name


def test_a_default_step_is_contained_and_says_how(victim):
    result = run_default_step("id -u", None)
    plan = result["details"]["plan"]
    assert plan["network"] == "none"
    assert plan["filesystem"] == "workspace"
    assert int(result["output"]["stdout"]) == plan["uid"] != 0
    assert all(plan["limits"][name] for name in ("processes", "cpu_seconds", "address_space_bytes", "open_files",
                                                  "file_size_bytes", "workspace_bytes"))


def _processes_of(uid: int) -> int:
    count = 0
    for process in psutil.process_iter():
        try:
            if process.uids().real == uid:
                count += 1
        except psutil.NoSuchProcess:
            pass
    return count


def _left_behind(handle_id: str, since: float) -> list[str]:
    """Processes of this host started for the step since ``since``: its shim,
    bubblewrap and the command's (any uid), found by the task directory in
    their command line or as descendants of this process. Not a count of the
    host's processes: other work runs beside the suite (its other workers)."""
    left = []
    for process in psutil.process_iter(["cmdline", "create_time", "pid", "status"]):
        info = process.info
        if (info["create_time"] or 0) >= since - 1 and info["status"] != psutil.STATUS_ZOMBIE and (
                handle_id in " ".join(info["cmdline"] or ())):
            left.append(f"{info['pid']} {' '.join(info['cmdline'] or ())[:120]}")
    for child in psutil.Process().children(recursive=True):
        try:
            if (child.create_time() >= since - 1 and child.status() != psutil.STATUS_ZOMBIE
                    and not _the_browser_s(child)):
                left.append(f"{child.pid} {' '.join(child.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return left


def _the_browser_s(process: psutil.Process) -> bool:
    """A process of the session's Chromium (the page tests', when they share
    this test process): it starts helpers of its own whenever it likes."""
    return any(ancestor.name().startswith("node") or "chromium" in ancestor.name()
               for ancestor in [process, *process.parents()])




@pytest.mark.parametrize("iteration", range(20))
def test_a_fork_bomb_in_a_default_step_stays_bounded(iteration):
    started = time.time()
    handle_id = f"t-{uuid.uuid4().hex[:16]}"
    plan = resolve_plan({}, mode="strict", uid_key=iteration)
    peak = {"count": 0}
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak["count"] = max(peak["count"], _processes_of(plan["uid"]))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        # Half a second: the bomb meets the process limit within milliseconds, and
        # every tenth of a second more is a core's worth of forking (20 repeats).
        result = executor.execute(handle_id, tool="shell", params={"argv": [SYSTEM_PYTHON, "-c", FORK_BOMB]},
                                  timeout_s=0.5, attempt=1, plan=plan)
    finally:
        done.set()
        sampler.join()
    assert result["details"]["termination"] == "timeout"
    assert 1 < peak["count"] <= plan["limits"]["processes"]
    assert wait_until(lambda: _processes_of(plan["uid"]) == 0, 10)
    assert wait_until(lambda: _left_behind(handle_id, started) == [], 10), _left_behind(handle_id, started)


@pytest.mark.parametrize("iteration", range(20))
def test_a_two_gigabyte_write_in_a_default_step_stops_at_the_quota(iteration):
    script = "dd if=/dev/zero of=a bs=1M count=1024 2>/dev/null; dd if=/dev/zero of=b bs=1M count=1024"
    result = run_default_step(script, None, timeout_s=60)

    assert result["status"] == "failed"
    assert result["details"]["termination"] == "workspace_limit"
    assert result["error"]["code"] == "external_failure"
    assert result["error"]["message"] == "the command filled its workspace quota"
    assert result["error"]["details"]["limits"]["workspace_bytes"] == settings.EXECGO_DEFAULT_LIMITS["workspace_bytes"]


def needs_pasta():
    from runtime.capabilities import capability_manifest

    return pytest.mark.skipif(not (capability_manifest().get("pasta") or {}).get("available"),
                              reason="the capability probe says pasta is unusable here")


NETWORK_ATTEMPTS = ["PostgreSQL over TCP", "PostgreSQL over its unix socket", "Redis over TCP",
                    "Redis over IPv6 loopback", "the web port on loopback", "the web port on the host's address",
                    "read the worker's environment", "read another step's stdout log"]


@needs_bubblewrap()
@needs_pasta()
@pytest.mark.parametrize("name", NETWORK_ATTEMPTS)
def test_a_step_with_outbound_network_still_does_not_reach_the_host(victim, web_port, name):
    plan = resolve_plan({"network": "internet"}, mode="strict")
    result = executor.execute(f"t-{uuid.uuid4().hex[:16]}", tool="shell",
                              params={"script": attempts(victim, web_port)[name]}, timeout_s=20, attempt=1, plan=plan)

    assert (result["details"]["plan"]["network"], result["details"]["termination"]) == ("internet", "exited")
    assert "ESCAPED" not in result["output"]["stdout"], (name, result["details"]["stderr"])


@needs_bubblewrap()
@needs_pasta()
def test_outbound_network_is_a_nat_of_its_own():
    plan = resolve_plan({"network": "internet"}, mode="strict")
    result = executor.execute(f"t-{uuid.uuid4().hex[:16]}", tool="shell", params={"script": "ip route; ip -br link"},
                              timeout_s=20, attempt=1, plan=plan)
    assert result["status"] == "success", result["details"]["stderr"]
    assert "default via" in result["output"]["stdout"]  # it has a way out
    # ...and without asking, none.
    none = run_default_step("ip route; ip -br link", None)
    assert "default via" not in none["output"]["stdout"]
    assert none["output"]["stdout"].strip().splitlines()[-1].startswith("lo ")
