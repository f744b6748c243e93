"""kill -9 of the Celery worker during 20 running steps: every step's result
is ingested or failed by recovery — none lost, none stuck running.

A real worker process ("crash-host", 20 pool processes) runs 20 one-step
runs whose shell commands wait on gate files, so the test — not the clock —
decides when each command ends. The worker's whole process group is then
SIGKILLed; the shims live in their own sessions and keep running. While no
worker is alive, some shims are allowed to finish and some are killed.
A new worker with the same host name starts, and at ``worker_ready``
re-attaches the live shims through the host queue. Then the remaining
commands finish, except two whose shims are killed under the re-attached
worker.

    group  n   while no worker          after the restart
    A      5   command finishes         (result read from result.json)
    K1     3   shim SIGKILLed           (failed: internal)
    B     10   still running            command finishes
    K2     2   still running            shim SIGKILLed -> failed: internal
"""

import io
import json
import os
import signal
import subprocess
from contextlib import contextmanager

import psutil
import pytest
from django.conf import settings
from django.core.management import call_command

from runs.dataplane import host_queue
from runs.models import AuditLog, Event, EventType, Run, Step, StepRunStatus
from runtime import attach, forkserver, layout, shim
from runtime.models import HostCapacity, Reservation
from tests.conftest import WorkerProcess, log_tails, purge_broker, stop_workers, wait_for_run, wait_until
from tests.reliability.checker import check_history

pytestmark = pytest.mark.django_db(transaction=True)

HOST = "crash-host"
HOST_ENV = {"EXECGO_HOST_NAME": HOST, "EXECGO_TASK_SLOTS": "40"}
GROUPS = ["B", "A", "B", "K1", "B", "A", "B", "K2", "B", "A",
          "B", "K1", "B", "A", "B", "K2", "B", "A", "B", "K1"]

def drop_messages_of_killed_workers() -> None:
    """With Redis, the messages a SIGKILLed worker held unacknowledged are
    handed to some worker once the visibility timeout has passed, which
    may be in a later test session, where run ids are reused. Put them back
    in their queues now, and purge those."""
    from execgo.celery import app

    if not app.conf.broker_url.startswith("redis"):
        return  # the filesystem transport deleted them when they were fetched
    with app.connection_for_write(transport_options={"visibility_timeout": 0}) as connection:
        connection.default_channel.qos.restore_visible(num=100_000, interval=1)
    purge_broker()


@contextmanager
def worker_logs_on_failure(*workers: WorkerProcess):
    """A failed assertion or wait says what the workers logged."""
    try:
        yield
    except (AssertionError, pytest.fail.Exception) as exc:
        raise AssertionError(f"{exc}{log_tails(*workers)}") from exc


def script(index: int, group: str, gates) -> str:
    # The gates appear in the step's own workspace (see open_gate).
    return (f'echo "::progress 10 waiting"; '
            f"while [ ! -e {group}-1 ]; do sleep 0.2; done; "
            f'echo "::progress 50 halfway"; '
            f"while [ ! -e {group}-2 ]; do sleep 0.2; done; "
            f"echo done-{index}")


def open_gate(gates, name: str) -> None:
    """Create the gate file in every running step's workspace. A contained
    step sees only its own workspace (a tmpfs in its mount namespace), which
    the test, as root, reaches through /proc/<pid>/root of its processes."""
    (gates / name).touch()
    for process in psutil.process_iter():
        try:
            handle_id = process.environ().get(shim.MARKER_ENV)
            if not handle_id:
                continue
            # As the step's uid: root is no uid of a bubblewrap sandbox's user namespace (EOVERFLOW).
            uid = process.uids().real
        except (psutil.Error, OSError):  # e.g. it ended meanwhile: a step's process of a killed shim
            continue
        subprocess.run(["touch", f"/proc/{process.pid}/root{layout.task_dir(handle_id)}/workspace/{name}"],
                       user=uid, group=uid, extra_groups=[], capture_output=True, check=False)


def progressed(step: Step, message: str) -> bool:
    return Event.objects.filter(run_id=step.run_id, task_id=step.step_id, type=EventType.TASK_PROGRESSED,
                                message=message).exists()


def shim_pid(handle_id: str) -> int:
    return json.loads((layout.task_dir(handle_id) / "shim.json").read_text())["pid"]


def kill_shim(handle_id: str) -> None:
    os.kill(shim_pid(handle_id), signal.SIGKILL)


def test_kill_9_of_the_worker_loses_no_step_and_leaves_none_running(api, tmp_path):
    gates = tmp_path / "gates"
    gates.mkdir()
    purge_broker()
    # Both consume only the default queue on the command line; each adds
    # its host's queue itself (celeryd_after_setup).
    first = WorkerProcess(hostname="crashy", concurrency=20, env=HOST_ENV)
    second = WorkerProcess(hostname="crashy-again", concurrency=20, env=HOST_ENV)
    try:
        with worker_logs_on_failure(first, second):
            run_ids, handles = crash_and_recover(api, gates, first, second)
    finally:
        for group in set(GROUPS):  # whatever happened, no command keeps waiting
            open_gate(gates, f"{group}-1")
            open_gate(gates, f"{group}-2")
        stop_workers(second, first)
        forkserver.stop_server(str(settings.EXECGO_TASKS_DIR))
        drop_messages_of_killed_workers()

    with worker_logs_on_failure(first, second):
        check_outcome(run_ids, handles)


def crash_and_recover(api, gates, first: WorkerProcess, second: WorkerProcess) -> tuple[list[int], dict[int, str]]:
    first.start()
    wait_until(lambda: HostCapacity.objects.filter(host=HOST).exists(), what="crash-host's ledger row")
    assert HostCapacity.objects.get(host=HOST).task_slots_capacity == 40
    assert f".> {host_queue(HOST)} " in first.log_path.read_text()

    run_ids = []
    for index, group in enumerate(GROUPS):
        plan = {"steps": [{"id": "wait", "tool": "shell", "timeout_s": 300, "retries": 0,
                           "params": {"script": script(index, group, gates)}}]}
        response = api.post("/api/v1/runs", {"title": f"crash-{index}", "plan": plan}, format="json")
        assert response.status_code == 201, response.content
        run_ids.append(response.json()["id"])

    def all_commands_running() -> bool:
        steps = list(Step.objects.filter(run_id__in=run_ids, run_status=StepRunStatus.RUNNING, host=HOST))
        return len(steps) == len(run_ids) and all(progressed(step, "waiting") for step in steps)

    wait_until(all_commands_running, timeout=180, what="20 running shell commands on crash-host")
    steps = {step.run_id: step for step in Step.objects.filter(run_id__in=run_ids)}
    handles = {run_id: steps[run_id].handle_id for run_id in run_ids}
    in_group = {group: [run_id for run_id, of in zip(run_ids, GROUPS) if of == group] for group in set(GROUPS)}
    assert HostCapacity.objects.get(host=HOST).task_slots_reserved == 20
    assert set(Reservation.objects.filter(host=HOST).values_list("handle_id", flat=True)) == set(handles.values())

    # kill -9 of the worker: its main process and all 20 pool processes.
    os.killpg(first.proc.pid, signal.SIGKILL)
    first.proc.wait(timeout=30)
    assert all(attach.shim_alive(handle) for handle in handles.values()), "a shim died with its worker"

    # No worker alive: group A's commands end, group K1's shims are killed.
    for run_id in in_group["K1"]:
        kill_shim(handles[run_id])
    open_gate(gates, "A-1")
    open_gate(gates, "A-2")
    wait_until(lambda: not any(attach.shim_alive(handles[run_id]) for run_id in in_group["A"] + in_group["K1"]),
               timeout=30, what="the end of groups A and K1")
    assert all(attach.read_result(handles[run_id])["status"] == "success" for run_id in in_group["A"])
    # Nobody ingested anything meanwhile.
    assert Step.objects.filter(run_id__in=run_ids, run_status=StepRunStatus.RUNNING).count() == 20
    assert not AuditLog.objects.filter(event="step_reattached").exists()

    second.start()
    assert f".> {host_queue(HOST)} " in second.log_path.read_text()
    # Recovery rebuilt the ledger: only the 12 shims still alive hold a slot,
    # and the steps of the 8 that are gone are settled.
    wait_until(lambda: HostCapacity.objects.get(host=HOST).task_slots_reserved == 12
               and not Step.objects.filter(run_id__in=in_group["A"] + in_group["K1"],
                                           run_status=StepRunStatus.RUNNING).exists(),
               timeout=60, what="recovery of groups A and K1")
    assert set(Reservation.objects.filter(host=HOST).values_list("handle_id", flat=True)) == {
        handles[run_id] for run_id in in_group["B"] + in_group["K2"]}

    # The re-attached worker follows the live shims: it records their progress.
    open_gate(gates, "B-1")
    open_gate(gates, "K2-1")
    wait_until(lambda: all(progressed(steps[run_id], "halfway") for run_id in in_group["B"] + in_group["K2"]),
               timeout=60, what="progress of the re-attached steps")
    for run_id in in_group["K2"]:
        kill_shim(handles[run_id])
    open_gate(gates, "B-2")

    for run_id in run_ids:
        wait_for_run(run_id, timeout=120)
    return run_ids, handles


def check_outcome(run_ids: list[int], handles: dict[int, str]) -> None:
    runs = Run.objects.in_bulk(run_ids)
    steps = {step.run_id: step for step in Step.objects.filter(run_id__in=run_ids)}
    assert len(steps) == 20
    assert not Step.objects.filter(run_id__in=run_ids,
                                   run_status__in=[StepRunStatus.RUNNING, StepRunStatus.ACCEPTED]).exists()
    for index, (run_id, group) in enumerate(zip(run_ids, GROUPS)):
        step, run = steps[run_id], runs[run_id]
        assert (step.host, step.attempt, step.handle_id) == (HOST, 1, handles[run_id])
        if group in ("A", "B"):
            assert (run.state, step.status, step.run_status) == ("SUCCEEDED", "success", "success"), (
                f"run {run_id} ({group}): {run.state} {step.result}")
            assert step.result["error"] is None
            assert step.result["output"]["exit_code"] == 0
            assert step.result["output"]["stdout"].endswith(f"done-{index}\n")
        else:
            assert (run.state, step.status, step.run_status) == ("CLOSED_FAILED", "failed", "failed"), (
                f"run {run_id} ({group}): {run.state} {step.result}")
            assert step.result["error"]["code"] == "internal", step.result
            assert "shim" in step.result["error"]["message"]

    reattached = {row.data["handle_id"]: row.data for row in AuditLog.objects.filter(event="step_reattached")}
    assert set(reattached) == set(handles.values())
    for run_id, group in zip(run_ids, GROUPS):
        # A shim that ended while no worker ran is ingested at once; one still
        # running is handed to the new worker's watcher, and recorded later.
        expected = steps[run_id].run_status if group in ("A", "K1") else StepRunStatus.RUNNING
        assert reattached[handles[run_id]]["status"] == expected
        assert reattached[handles[run_id]]["attempt"] == 1
    # Each result was applied exactly once: nothing reached a fence twice.
    assert not AuditLog.objects.filter(run_id__in=run_ids, event="stale_result_ignored").exists()
    assert Event.objects.filter(run_id__in=run_ids,
                                type__in=[EventType.TASK_SUCCEEDED, EventType.TASK_FAILED]).count() == 20

    ledger = HostCapacity.objects.get(host=HOST)
    assert (ledger.task_slots_reserved, ledger.memory_bytes_reserved, ledger.pids_reserved) == (0, 0, 0)
    assert not Reservation.objects.filter(host=HOST).exists()
    assert not any(attach.shim_alive(handle) for handle in handles.values())
    out = io.StringIO()
    call_command("execgo_reconcile", stdout=out)
    assert "all invariants hold" in out.getvalue()
    assert check_history(run_ids) == []
