"""Workers announce their host and capabilities; a step runs only on a host
that can honour the plan the policy rated it on: a step rated in
linux_sandbox (a strict request, and a default step rated where bubblewrap
works) never runs on a host without it. Two workers with different host
names on one machine demonstrate this: "plain-host" is told its bubblewrap
is at a path where there is none, "boxed-host" has the real one.
"""

import io
import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest
from django.conf import settings
from django.core.management import call_command
from django.test import override_settings

from runs.dataplane import (
    SANDBOX_QUEUE,
    capability_queue,
    capability_queues,
    host_queue,
    new_handle_id,
    plan_needs,
    rated_part,
    weaker_than_rated,
)
from runs.execution import step_execute
from runs.models import Run, Step
from runtime import forkserver, layout, ledger
from runtime.capabilities import capability_manifest
from runtime.envelopes import EnvelopeError
from runtime.models import HostCapacity, Reservation
from runtime.plan_resolver import resolve_plan
from tests.conftest import ROOT, WorkerProcess, log_tails, purge_broker, stop_workers, wait_for_run, wait_until

PLAIN, BOXED = "plain-host", "boxed-host"
NO_BWRAP = "/nonexistent/bwrap"
STRICT_SANDBOX = {"profile": "linux_sandbox", "mode": "strict"}
PROCESS = {"profile": "process"}


def one_step(script: str, sandbox: dict | None = None) -> dict:
    step = {"id": "only", "tool": "shell", "params": {"script": script}, "timeout_s": 60}
    if sandbox:
        step["sandbox"] = sandbox
    return {"steps": [step]}


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(not capability_manifest()["bubblewrap"]["available"],
                    reason="the capability probe says bubblewrap is unusable on this machine")
def test_strict_sandbox_steps_run_only_on_the_host_that_has_bubblewrap(api):
    outside = settings.DATA_DIR / f"outside-{uuid.uuid4().hex[:12]}"
    outside.mkdir()
    outside.chmod(0o777)  # writable by anyone: only a sandbox can stop a write here
    purge_broker()
    plain = WorkerProcess(hostname="plain", concurrency=2, env={"EXECGO_HOST_NAME": PLAIN, "EXECGO_BWRAP_PATH": NO_BWRAP})
    boxed = WorkerProcess(hostname="boxed", concurrency=2, env={"EXECGO_HOST_NAME": BOXED})
    try:
        plain.start()
        boxed.start()
        wait_until(lambda: HostCapacity.objects.filter(host__in=[PLAIN, BOXED]).count() == 2,
                   what="both hosts' ledger rows")
        announced = {row.host: row.capabilities for row in HostCapacity.objects.filter(host__in=[PLAIN, BOXED])}

        submitted: dict[str, list[int]] = {"sandboxed": [], "anywhere": [], "by-default": []}

        def submit(kind: str, plan: dict) -> int:
            response = api.post("/api/v1/runs", {"title": kind, "plan": plan}, format="json")
            assert response.status_code == 201, response.content
            submitted.setdefault(kind, []).append(response.json()["id"])
            return response.json()["id"]

        # Process-profile steps take a second each, so that with two pool
        # processes per worker both workers must take some of them.
        for index in range(6):
            submit("anywhere", one_step(f"sleep 1; echo anywhere-{index}", PROCESS))
            submit("sandboxed", one_step(f"echo boxed-{index}; id -u", STRICT_SANDBOX))
            submit("by-default", one_step(f"echo default-{index}"))  # rated here, where bubblewrap works
        escape_sandboxed = submit("escape", one_step(f"echo escaped > {outside}/from-sandbox", STRICT_SANDBOX))
        escape_process = submit("escape", one_step(f"echo escaped > {outside}/from-process", PROCESS))

        runs = {run_id: wait_for_run(run_id, timeout=120) for ids in submitted.values() for run_id in ids}
    finally:
        stop_workers(plain, boxed)
        forkserver.stop_server(str(settings.EXECGO_TASKS_DIR))
    logs = log_tails(plain, boxed)
    steps = {step.run_id: step for step in Step.objects.filter(run_id__in=runs)}
    try:
        # Each worker announced its own host and what it can do.
        assert announced[PLAIN]["host"]["name"] == PLAIN
        assert announced[PLAIN]["bubblewrap"]["available"] is False
        assert announced[PLAIN]["bubblewrap"]["path"] == NO_BWRAP
        assert announced[BOXED]["host"]["name"] == BOXED
        assert announced[BOXED]["bubblewrap"]["available"] is True
        # ...and consumes the sandbox queue only if it has the sandbox.
        plain_log, boxed_log = plain.log_path.read_text(), boxed.log_path.read_text()
        assert f".> {host_queue(PLAIN)} " in plain_log and f".> {host_queue(BOXED)} " in boxed_log
        assert f".> {SANDBOX_QUEUE} " not in plain_log
        assert f".> {SANDBOX_QUEUE} " in boxed_log
        namespaces = capability_queue(frozenset({"namespaces"}))
        assert f".> {namespaces} " in plain_log and f".> {namespaces} " in boxed_log

        for index, run_id in enumerate(submitted["sandboxed"]):
            step = steps[run_id]
            assert (runs[run_id].state, step.status) == ("SUCCEEDED", "success"), (run_id, step.result)
            assert step.host == BOXED
            plan = step.effective_plan
            assert (plan["profile"], plan["requested_profile"], plan["mode"]) == ("linux_sandbox", "linux_sandbox",
                                                                                  "strict")
            assert (plan["network"], plan["host"], plan["downgrades"]) == ("none", BOXED, [])
            assert step.result["output"]["stdout"].startswith(f"boxed-{index}\n")

        # Rated in the sandbox (where the policy rated them, bubblewrap works):
        # never run on the host without it, though it would have taken them.
        for index, run_id in enumerate(submitted["by-default"]):
            step = steps[run_id]
            assert (runs[run_id].state, step.status) == ("SUCCEEDED", "success"), (run_id, step.result)
            assert step.rated_plan["profile"] == "linux_sandbox"
            assert (step.host, step.effective_plan["profile"]) == (BOXED, "linux_sandbox")
            assert step.result["output"]["stdout"] == f"default-{index}\n"

        hosts = set()
        for index, run_id in enumerate(submitted["anywhere"]):
            step = steps[run_id]
            assert (runs[run_id].state, step.status) == ("SUCCEEDED", "success"), (run_id, step.result)
            # Rated as the contained process profile: any host that has its namespaces runs it.
            assert step.rated_plan["profile"] == "process" and step.rated_plan["namespaces"] is True
            assert (step.effective_plan["profile"], step.effective_plan["namespaces"]) == ("process", True)
            assert step.effective_plan["network"] == "none"
            assert step.effective_plan["host"] == step.host
            assert step.result["output"]["stdout"] == f"anywhere-{index}\n"
            hosts.add(step.host)
        # plain-host took work: that it never ran a sandbox step is routing.
        assert PLAIN in hosts and hosts <= {PLAIN, BOXED}, hosts

        # Writing outside the workspace: refused in the sandbox and in the default profile alike.
        step = steps[escape_sandboxed]
        assert (runs[escape_sandboxed].state, step.status, step.host) == ("CLOSED_FAILED", "failed", BOXED)
        assert step.effective_plan["profile"] == "linux_sandbox"
        assert step.result["error"]["code"] == "external_failure"
        assert step.result["output"]["exit_code"] != 0
        assert not (outside / "from-sandbox").exists()
        step = steps[escape_process]
        assert (runs[escape_process].state, step.status) == ("CLOSED_FAILED", "failed"), step.result
        assert step.effective_plan["filesystem"] == "workspace"
        assert not (outside / "from-process").exists()

        for host in (PLAIN, BOXED):
            ledger = HostCapacity.objects.get(host=host)
            assert (ledger.task_slots_reserved, ledger.memory_bytes_reserved, ledger.pids_reserved) == (0, 0, 0)
        assert not Reservation.objects.exists()
        out = io.StringIO()
        call_command("execgo_reconcile", stdout=out)
        assert "all invariants hold" in out.getvalue()
    except AssertionError as exc:
        raise AssertionError(f"{exc}{logs}") from exc
    finally:
        shutil.rmtree(outside, ignore_errors=True)


@pytest.mark.django_db
def test_a_host_without_bubblewrap_refuses_a_strict_sandbox_step_before_running_it(make_run):
    without = {**capability_manifest(), "bubblewrap": {"available": False, "path": None, "error": "bwrap not installed"}}
    with pytest.raises(EnvelopeError) as refused:
        resolve_plan({"profile": "linux_sandbox"}, mode="strict", manifest=without)
    assert (refused.value.envelope["code"], refused.value.envelope["source"]) == ("denied", "executor")
    assert refused.value.envelope["details"]["what"] == "profile"
    downgraded = resolve_plan({"profile": "linux_sandbox"}, mode="adaptive", manifest=without)
    assert downgraded["profile"] == "process"
    assert [(d["what"], d["requested"], d["effective"]) for d in downgraded["downgrades"]] == [
        ("profile", "linux_sandbox", "process")]

    # The same refusal where a step runs: this process, probed as a host whose
    # bubblewrap is missing, is handed an accepted strict linux_sandbox step.
    run = make_run("EXECUTING")
    step = Step.objects.create(run=run, step_id="a", position=0, tool="shell", params={"script": "touch ran"},
                               timeout_s=10, requested_plan=STRICT_SANDBOX)
    handle = new_handle_id(step, 1)
    Step.objects.filter(pk=step.pk).update(run_status="accepted", attempt=1, handle_id=handle)
    try:
        with override_settings(EXECGO_BWRAP_PATH=NO_BWRAP, EXECGO_HOST_NAME="bare-host"):
            assert capability_manifest(refresh=True)["bubblewrap"]["available"] is False
            assert step_execute(step.pk, 1) is None
    finally:
        capability_manifest(refresh=True)  # the real probe again, for whoever comes next

    step.refresh_from_db()
    assert (step.status, step.run_status, step.attempt, step.host) == ("failed", "failed", 1, "bare-host")
    assert step.effective_plan == {}
    error = step.result["error"]
    assert (error["code"], error["source"], error["details"]["what"]) == ("denied", "executor", "profile")
    assert "linux_sandbox" in error["message"]
    assert not layout.task_dir(handle).exists()  # nothing was prepared, let alone launched
    assert not Reservation.objects.filter(handle_id=handle).exists()
    assert not HostCapacity.objects.filter(host="bare-host").exists()
    assert Run.objects.get(pk=run.pk).state == "CLOSED_FAILED"


def test_worker_host_settings_come_from_the_environment():
    code = ("import django, json; django.setup(); from django.conf import settings; "
            "from runtime.capabilities import host_name; from runtime.sandbox_argv import bwrap_path; "
            "print(json.dumps([host_name(), bwrap_path(), getattr(settings, 'EXECGO_TASK_SLOTS', None)]))")
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "execgo.settings", "EXECGO_HOST_NAME": "env-host",
           "EXECGO_BWRAP_PATH": NO_BWRAP, "EXECGO_TASK_SLOTS": "7"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["env-host", NO_BWRAP, 7]


def deliver_sandbox_rated_step_to_a_bare_host(run: Run) -> tuple[Step, str]:
    """A default step of ``run``, rated in linux_sandbox, accepted and
    delivered to this process probed as "bare-host", whose bubblewrap is
    missing; the step as it stands after, and its handle."""
    step = Step.objects.create(run=run, step_id="a", position=0, tool="shell", params={"script": "touch ran"},
                               timeout_s=10)
    rated = rated_part(resolve_plan({}, mode=None, uid_key=step.pk))
    assert rated["profile"] == "linux_sandbox"
    handle = new_handle_id(step, 1)
    Step.objects.filter(pk=step.pk).update(run_status="accepted", attempt=1, handle_id=handle, rated_plan=rated)
    try:
        with override_settings(EXECGO_BWRAP_PATH=NO_BWRAP, EXECGO_HOST_NAME="bare-host"):
            assert capability_manifest(refresh=True)["bubblewrap"]["available"] is False
            assert step_execute(step.pk, 1) is None
    finally:
        capability_manifest(refresh=True)  # the real probe again, for whoever comes next
    step.refresh_from_db()
    return step, handle


@pytest.mark.django_db
def test_a_host_that_would_run_a_step_weaker_than_it_was_rated_refuses_it(make_run):
    """A default step rated (and maybe approved) in the sandbox, delivered to
    a host without bubblewrap: with no other host up that has it, the step
    fails with ``denied`` and says why, before anything runs; the adaptive
    default never quietly becomes the process profile there."""
    run = make_run("EXECUTING")
    step, handle = deliver_sandbox_rated_step_to_a_bare_host(run)
    assert (step.status, step.run_status, step.host) == ("failed", "failed", "bare-host")
    error = step.result["error"]
    assert (error["code"], error["source"]) == ("denied", "executor")
    assert "weaker than the plan it was rated on (profile process" in error["message"]
    assert error["details"]["needs"] == ["bubblewrap"]
    assert not layout.task_dir(handle).exists()
    assert Run.objects.get(pk=run.pk).state == "CLOSED_FAILED"


@pytest.mark.django_db(transaction=True)
def test_a_host_that_would_run_a_step_weaker_hands_it_to_a_host_that_can_honour_its_rated_plan(make_run):
    """The same delivery while a host that has bubblewrap was seen lately:
    nothing runs here; the attempt goes, still accepted, to the queue of the
    hosts that can run it as rated."""
    from tests.runs.test_ledger_heal import queued

    run = make_run("EXECUTING", timeout_s=120)
    ledger.host_register(BOXED, task_slots=2, memory_bytes=2**30, pids=64, capabilities=capability_manifest())
    purge_broker()
    step, handle = deliver_sandbox_rated_step_to_a_bare_host(run)
    assert (step.status, step.run_status, step.attempt, step.host, step.result) == ("pending", "accepted", 1, "", None)
    assert not layout.task_dir(handle).exists()  # nothing prepared on the host that would run it weaker
    assert [(m["task"], m["args"]) for m in queued(SANDBOX_QUEUE)] == [("runs.tasks.execute_step", [step.pk, 1])]
    assert Run.objects.get(pk=run.pk).state == "EXECUTING"


def test_what_counts_as_weaker_than_the_rated_plan():
    rated = {"profile": "linux_sandbox", "namespaces": False, "network": "none", "filesystem": "workspace",
             "uid": "own", "limits": {"processes": 64, "cpu_seconds": 600}}
    same = {**rated, "uid": 1000007, "host": "elsewhere"}
    assert weaker_than_rated(same, rated) == []
    assert weaker_than_rated({**same, "limits": {"processes": 32, "cpu_seconds": 60}}, rated) == []  # tighter
    process = {**same, "profile": "process", "namespaces": True}
    assert weaker_than_rated(process, rated) == ["profile process without namespaces instead of linux_sandbox"]
    assert weaker_than_rated({**same, "network": "internet"}, rated) == ["network internet instead of none"]
    assert weaker_than_rated({**same, "filesystem": "host"}, rated) == ["filesystem host instead of the workspace"]
    assert weaker_than_rated({**same, "uid": None}, rated) == ["the worker's own uid instead of a uid of its own"]
    filtered = {**rated, "seccomp": True}
    assert weaker_than_rated({**same, "seccomp": True}, filtered) == []
    assert weaker_than_rated({**same, "seccomp": False}, filtered) == ["no system-call filter"]
    assert weaker_than_rated({**same, "limits": {"processes": None, "cpu_seconds": 600}}, rated) == [
        "limit processes None instead of 64"]
    # A stronger plan than the rated one is not weaker; no rated plan binds nothing.
    assert weaker_than_rated(same, {**rated, "profile": "process", "namespaces": True}) == []
    assert weaker_than_rated(process, {}) == []
    assert (plan_needs(rated), plan_needs({**rated, "network": "internet"})) == (
        frozenset({"bubblewrap"}), frozenset({"bubblewrap", "pasta"}))
    assert capability_queue(frozenset({"bubblewrap"})) == SANDBOX_QUEUE
    assert capability_queue(frozenset()) == "celery"
    assert sorted(capability_queues(frozenset({"bubblewrap", "namespaces"}))) == sorted(
        [SANDBOX_QUEUE, "execgo.needs.namespaces", "execgo.needs.bubblewrap+namespaces"])
