"""Steps that wait do not hold a worker (docs/data-plane.md#steps-that-do-not-hold-a-worker).

A pool process hands a step still running after EXECGO_STEP_HAND_OFF_S to
its worker's watcher and takes other work; the watcher reports the end and
a task records the result. On a real worker: a quick run gets through
while long steps fill every pool process's worth of work, a watched step's
progress, output and cancel behave as before, a pool process killed after
the hand-off costs its step nothing, and neither a step nor any other
process can hand the watcher a step of its own.
"""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
from django.conf import settings

from runs.models import AuditLog, Event, EventType, Step, StepRunStatus
from runtime import layout, shim, watcher
from runtime.models import Reservation
from runtime.shim_process import process_create_time
from tests.conftest import WorkerProcess, log_tails, purge_broker, wait_for_run, wait_until

HOST = "watch-host"
ENV = {"EXECGO_HOST_NAME": HOST, "EXECGO_TASK_SLOTS": "8"}


def shell_plan(script: str, **step) -> dict:
    return {"steps": [{"id": "only", "tool": "shell", "params": {"script": script}, **step}]}


def submit(api, plan: dict) -> int:
    response = api.post("/api/v1/runs", {"title": "watched", "plan": plan}, format="json")
    assert response.status_code == 201, response.content
    return response.json()["id"]


def watched_by(worker: WorkerProcess, run_ids: list[int]) -> bool:
    """Every run's step is running and its slot belongs to the worker's main
    process: the pool process that launched it handed it over."""
    handles = list(Step.objects.filter(run_id__in=run_ids, run_status=StepRunStatus.RUNNING)
                   .values_list("handle_id", flat=True))
    return len(handles) == len(run_ids) and Reservation.objects.filter(
        handle_id__in=handles, owner_pid=worker.proc.pid).count() == len(run_ids)


@pytest.fixture
def worker(transactional_db):
    purge_broker()
    started = WorkerProcess(hostname="watching", concurrency=2, env=ENV).start()
    try:
        yield started
    finally:
        started.stop()


@pytest.mark.django_db(transaction=True)
def test_a_quick_run_gets_through_while_long_steps_run(api, worker):
    try:
        sleepers = [submit(api, shell_plan("sleep 120", timeout_s=300)) for _ in range(3)]
        wait_until(lambda: watched_by(worker, sleepers), timeout=60, what="three sleepers handed to the watcher")

        quick = [submit(api, shell_plan("echo quick")) for _ in range(3)]
        for run_id in quick:
            run = wait_for_run(run_id, timeout=60)
            assert run.state == "SUCCEEDED", run.state
            assert run.steps.get().result["output"]["stdout"] == "quick\n"
        # Far sooner than the sleepers' end: they still run, each still holding its slot.
        assert Step.objects.filter(run_id__in=sleepers, run_status=StepRunStatus.RUNNING).count() == 3
        assert watched_by(worker, sleepers)
        handles = list(Step.objects.filter(run_id__in=sleepers).values_list("handle_id", flat=True))

        # A cancel reaches a watched step: the watcher asks for its run's cancel each tick.
        for run_id in sleepers:
            assert api.post(f"/api/v1/runs/{run_id}/cancel", {"reason": "enough"}, format="json").status_code == 202
        for run_id in sleepers:
            run = wait_for_run(run_id, timeout=60)
            assert run.state == "CLOSED_CANCELLED", run.state
            assert run.steps.get().run_status == StepRunStatus.CANCELLED
    except (AssertionError, pytest.fail.Exception) as exc:
        raise AssertionError(f"{exc}{log_tails(worker)}") from exc
    # A slot is given back once its shim has ended and that end is recorded, which may come after
    # the cancel closed the run.
    wait_until(lambda: not Reservation.objects.filter(handle_id__in=handles).exists(), timeout=30,
               what="the sleepers' slots given back")
    for handle in handles:  # the shims and their commands are gone
        info = json.loads((layout.task_dir(handle) / shim.SHIM_FILE).read_text())
        assert not psutil.pid_exists(info["pid"]) or psutil.Process(info["pid"]).status() == psutil.STATUS_ZOMBIE


@pytest.mark.django_db(transaction=True)
def test_a_watched_step_reports_progress_output_and_its_result(api, worker):
    script = ("echo '::progress 20 started'; sleep 1; echo '::progress 70 most'; sleep 0.5; "
              "echo out; echo err >&2; exit 3")
    run_id = submit(api, shell_plan(script, retries=0))
    try:
        wait_until(lambda: watched_by(worker, [run_id]), timeout=60, what="the step handed to the watcher")
        run = wait_for_run(run_id, timeout=60)
    except (AssertionError, pytest.fail.Exception) as exc:
        raise AssertionError(f"{exc}{log_tails(worker)}") from exc
    assert run.state == "CLOSED_FAILED"
    step = run.steps.get()
    assert step.run_status == StepRunStatus.FAILED
    assert step.result["output"]["exit_code"] == 3
    assert step.result["output"]["stdout"].endswith("out\n")
    assert step.result["details"]["stderr"] == "err\n"
    progressed = Event.objects.filter(run=run, type=EventType.TASK_PROGRESSED).order_by("id")
    assert [(e.data["progress"], e.message) for e in progressed] == [(20, "started"), (70, "most")]
    types = list(Event.objects.filter(run=run, task_id="only").values_list("type", flat=True))
    assert types == ["task_submitted", "task_accepted", "task_started", "task_progressed", "task_progressed",
                     "task_failed"]
    assert "runs.tasks.record_watched_step" in worker.log_path.read_text()
    # given back just after the run closed, by the task that recorded the step's end
    wait_until(lambda: not Reservation.objects.filter(handle_id=step.handle_id).exists(), timeout=30,
               what="the step's slot given back")


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(settings.IS_SQLITE, reason="the embedded broker's pool shares one task queue whose lock an idle "
                    "pool process holds while it waits: killing one stops the pool (docs/data-plane.md)")
def test_pool_processes_killed_after_the_hand_off_cost_the_step_nothing(api, worker):
    run_id = submit(api, shell_plan("sleep 2; echo survived", retries=0))
    try:
        wait_until(lambda: watched_by(worker, [run_id]), timeout=60, what="the step handed to the watcher")
        for child in psutil.Process(worker.proc.pid).children():
            child.send_signal(signal.SIGKILL)
        run = wait_for_run(run_id, timeout=60)
    except (AssertionError, pytest.fail.Exception) as exc:
        raise AssertionError(f"{exc}{log_tails(worker)}") from exc
    assert run.state == "SUCCEEDED"
    step = run.steps.get()
    assert step.attempt == 1 and step.result["output"]["stdout"] == "survived\n"
    # Its slot was the main process's: no heal reclaimed it, nothing re-attached it.
    assert not AuditLog.objects.filter(event__in=["reservation_reclaimed", "step_reattached"],
                                       data__handle_id=step.handle_id).exists()


@pytest.mark.django_db(transaction=True)
def test_a_step_cannot_reach_the_watcher(api, worker):
    """A step that knows the watcher's address tries to hand it a step of
    its own: contained, it has no route to the socket at all."""
    address = watcher.address(worker.proc.pid)
    forged = json.dumps({"handle_id": "forged", "ref": {"step": 1, "attempt": 1, "run": 1}, "info": None})
    code = ("import socket,sys\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
            f"try:\n    s.sendto({forged.encode()!r}, {address!r})\n"
            "except OSError as exc:\n    print('refused', type(exc).__name__)\nelse:\n    print('sent')\n")
    run_id = submit(api, {"steps": [{"id": "only", "tool": "shell", "retries": 0,
                                     "params": {"argv": ["python3", "-c", code]}}]})
    try:
        run = wait_for_run(run_id, timeout=60)
    except (AssertionError, pytest.fail.Exception) as exc:
        raise AssertionError(f"{exc}{log_tails(worker)}") from exc
    stdout = run.steps.get().result["output"]["stdout"]
    from runs.dataplane import can_sandbox

    if can_sandbox():
        assert stdout == "refused ConnectionRefusedError\n", run.steps.get().result
    else:  # the process profile shares the network namespace: the watcher refuses the sender
        assert stdout == "sent\n"
        wait_until(lambda: "ignored a hand-off from pid" in worker.log_path.read_text(), timeout=10,
                   what="the watcher's refusal")
    assert "forged" not in worker.log_path.read_text()


# The watcher's mechanics, in this process (no worker): who may hand over,
# what ends a watch, and a report that fails.


class Reports:
    """The harness's side: ``fail`` reports refused first (a broker down);
    a reported step counts as recorded once ``recorded`` holds its handle,
    or at once with ``record_at_once``."""

    def __init__(self, fail: int = 0, record_at_once: bool = True):
        self.ended, self.fail, self.record_at_once, self.recorded = [], fail, record_at_once, set()

    def on_end(self, watched):
        if self.fail:
            self.fail -= 1
            raise RuntimeError("the broker is down")
        self.ended.append(watched)
        if self.record_at_once:
            self.recorded.add(watched.handle_id)

    def on_recorded(self, watched):
        return {w.handle_id for w in watched if w.handle_id in self.recorded}


@contextlib.contextmanager
def sending(process_argv_prefix: list[str], pid: int, handle_id: str, sleeper_pid: int):
    """Send a hand-off to the watcher of ``pid`` from a new process, run as
    ``process_argv_prefix + [python, -c, ...]``, which lives on until the
    block ends: the watcher asks who sent a message when it reads it, and a
    sender gone by then (on a busy machine, its thread not scheduled in
    time) is refused whoever it was."""
    info = {"pid": sleeper_pid, "create_time": process_create_time(sleeper_pid)}
    message = json.dumps({"handle_id": handle_id, "ref": {"step": 7, "attempt": 1, "run": 3}, "info": info})
    code = f"import socket, sys; socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto({message.encode()!r}, " \
           f"{watcher.address(pid)!r}); print('sent', flush=True); sys.stdin.read()"
    sender = subprocess.Popen([*process_argv_prefix, sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert sender.stdout.readline() == "sent\n"
        yield sender
    finally:
        sender.stdin.close()
        assert sender.wait(timeout=30) == 0
        sender.stdout.close()


@pytest.fixture
def in_process_watcher(settings, tmp_path):
    settings.EXECGO_TASKS_DIR = tmp_path / "tasks"
    made = []

    def start(reports: Reports, **kwargs):
        made.append(watcher.Watcher(ended=reports.on_end, recorded=reports.on_recorded,
                                    cancelled=lambda watched: set(), progress=lambda *args: None, tick_s=0.05,
                                    **kwargs).start())
        return made[-1]

    yield start
    for running in made:
        running.stop()


def test_the_watcher_takes_its_children_s_hand_offs_and_reports_their_end(in_process_watcher):
    reports = Reports(fail=2)
    running = in_process_watcher(reports)
    layout.task_dir("h-mine").mkdir(parents=True)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        with sending([], os.getpid(), "h-mine", sleeper.pid):  # a child of this process: taken
            wait_until(lambda: "h-mine" in running.watched, timeout=10, what="the hand-off")
        time.sleep(0.3)
        assert reports.ended == []
        sleeper.kill()
        # The first two reports fail (a broker down): the end is reported later, not lost.
        wait_until(lambda: len(reports.ended) == 1, timeout=10, what="the report of the end")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert reports.ended[0].handle_id == "h-mine" and reports.ended[0].ref == {"step": 7, "attempt": 1, "run": 3}
    assert running.watched == {}
    # No result from the "shim": one is recorded, saying so.
    recorded = json.loads((layout.task_dir("h-mine") / shim.RESULT_FILE).read_text())
    assert "without writing result.json" in recorded["shim_error"]


def test_a_report_the_broker_lost_is_sent_again_until_the_result_is_recorded(in_process_watcher):
    reports = Reports(record_at_once=False)
    running = in_process_watcher(reports, report_again_s=0.2)
    layout.task_dir("h-lost").mkdir(parents=True)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        with sending([], os.getpid(), "h-lost", sleeper.pid):
            wait_until(lambda: "h-lost" in running.watched, timeout=10, what="the hand-off")
        sleeper.kill()
        # Taken by the "broker" each time, never recorded: reported again, with a growing wait.
        wait_until(lambda: len(reports.ended) >= 3, timeout=15, what="the report sent again")
    finally:
        sleeper.kill()
        sleeper.wait()
    reports.recorded.add("h-lost")  # the result is in now
    time.sleep(1.5)  # the next confirmation (every second) forgets it
    count = len(reports.ended)
    time.sleep(2.0)
    assert len(reports.ended) == count and running.reported == {}
    assert {watched.handle_id for watched in reports.ended} == {"h-lost"}


def test_the_watcher_ignores_a_hand_off_from_a_process_that_is_not_its_child(in_process_watcher, caplog):
    reports = Reports()
    running = in_process_watcher(reports)
    layout.task_dir("h-forged").mkdir(parents=True)
    sleeper = subprocess.Popen(["sleep", "60"])
    refused = re.compile(r"ignored a hand-off from pid (\d+), not one of its pool processes")
    try:
        # A grandchild of this process (the shell's child) sends it, and is
        # still there when the watcher asks who it is.
        with sending(["sh", "-c", '"$@"; exit $?', "sh"], os.getpid(), "h-forged", sleeper.pid) as shell:
            wait_until(lambda: refused.search(caplog.text), timeout=10, what="the refusal")
            assert psutil.Process(int(refused.search(caplog.text)[1])).ppid() == shell.pid
        assert running.watched == {}
        sleeper.kill()
        time.sleep(0.3)
        assert reports.ended == []
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_watcher_kills_a_shim_that_overruns_its_backstop(in_process_watcher, settings):
    settings.EXECGO_SHIM_BACKSTOP_S = 0.2
    reports = Reports()
    running = in_process_watcher(reports)
    directory = layout.task_dir("h-stuck")
    directory.mkdir(parents=True)
    (directory / shim.REQUEST_FILE).write_text(json.dumps({"timeout_s": 0.2, "kill_grace_s": 0.1}))
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        with sending([], os.getpid(), "h-stuck", sleeper.pid):
            wait_until(lambda: "h-stuck" in running.watched, timeout=10, what="the hand-off")
        wait_until(lambda: len(reports.ended) == 1, timeout=10, what="the backstop")
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
    finally:
        sleeper.kill()
        sleeper.wait()
    recorded = json.loads((directory / shim.RESULT_FILE).read_text())
    assert "overran its timeout" in recorded["shim_error"]


def test_no_watcher_means_the_pool_process_waits_itself():
    # This process's parent runs no watcher: the hand-off is refused, so the caller waits on.
    assert watcher.hand_off("h-nobody", ref={"step": 1, "attempt": 1, "run": 1}, info=None) is False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        with pytest.raises(ConnectionRefusedError):
            sock.sendto(b"{}", watcher.address(os.getppid()))
