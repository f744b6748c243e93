"""No parked deadlines: an EXECUTING run past its deadline is ended by the
beat-driven deadline scan when its timer (an ETA message) was never sent,
was lost with a killed worker (filesystem broker), or sits in a dead
worker's unacked set (Redis). Within the grace a running step is left to
its own timeout; after it the run is forced to TIMEOUT, its steps fenced."""

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.db import DatabaseError
from django.utils import timezone

from runs import deadlines
from runs.deadlines import deadline_enforce, overdue_runs, scan_deadlines
from runs.errors import ErrorCode, error_envelope
from runs.execution import step_finish
from runs.models import AuditLog, Run, Step, StepRunStatus, StepStatus, Trace, TraceKind
from runs.statemachine import FINAL
from runs.tasks import settle_run
from runtime.envelopes import failed_result
from tests.conftest import ROOT, WorkerProcess, _worker_env, log_tails, purge_broker, stop_workers, wait_for_run
from tests.runs.conftest import start_attempt

pytestmark = pytest.mark.django_db(transaction=True)


class BeatProcess:
    """A real ``celery beat`` (the database scheduler) against the test
    database, with the schedule's intervals from ``env``."""

    def __init__(self, env: dict):
        self.env = env
        self.log_path = Path(settings.DATA_DIR) / "beat.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "BeatProcess":
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "execgo", "beat", "-l", "INFO", "--max-interval", "1"],
            cwd=ROOT, env={**_worker_env(), **self.env}, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc:
            self.log.close()


def overdue_run(make_run, *, late_s: float, timeout_s: int = 2, step_running: bool = False) -> Run:
    run = make_run("EXECUTING", previous_state="POLICY_CHECK", timeout_s=timeout_s,
                   executing_started_at=timezone.now() - timedelta(seconds=timeout_s + late_s))
    step = Step.objects.create(run=run, step_id="a", position=0, tool="shell", params={"argv": ["true"]},
                               timeout_s=5, retries=0)
    if step_running:
        start_attempt(step)
    return run


def final_audit_rows(run: Run) -> list[str]:
    return list(AuditLog.objects.filter(run_id=run.pk, event__in=["run_failed", "run_succeeded", "run_rejected",
                                                                  "run_cancelled"]).values_list("event", flat=True))


def timeout_row(run: Run) -> tuple[str, dict]:
    """Caller and data of the audit row of the run's move to TIMEOUT."""
    row = AuditLog.objects.get(run_id=run.pk, event="state_changed", to_state="TIMEOUT")
    return row.caller, row.data


def test_a_run_whose_timer_was_never_sent_is_closed_by_the_scan(make_run):
    run = overdue_run(make_run, late_s=1)

    assert scan_deadlines() == [run.pk]

    run.refresh_from_db()
    assert (run.state, run.closing_cause) == ("CLOSED_FAILED", "run_timeout")
    assert Step.objects.get(run=run).status == StepStatus.SKIPPED
    enforced = AuditLog.objects.get(run_id=run.pk, event="deadline_enforced")
    assert enforced.data["forced"] is False and enforced.data["late_s"] >= 1
    # The scan settled it as the timer would have: the timeout's row names the scan.
    assert timeout_row(run) == ("deadline scan", {"layer": "harness"})
    assert final_audit_rows(run) == ["run_failed"]
    assert scan_deadlines() == []  # a final run is out of the scan


def test_a_step_without_a_live_executor_is_fenced_and_the_run_forced_after_the_grace(make_run, settings):
    settings.EXECGO_DEADLINE_GRACE_S = 3.0
    run = overdue_run(make_run, late_s=5, step_running=True)

    assert scan_deadlines() == [run.pk]

    run.refresh_from_db()
    assert run.state == "CLOSED_FAILED"
    step = Step.objects.get(run=run)
    assert (step.status, step.run_status) == (StepStatus.FAILED, StepRunStatus.CANCELLED)
    assert AuditLog.objects.get(run_id=run.pk, event="deadline_enforced").data["forced"] is True
    trace = Trace.objects.get(run=run, kind=TraceKind.RUN, data__layer="deadline_scan")
    assert trace.error["code"] == "timeout"
    assert final_audit_rows(run) == ["run_failed"]


def test_a_run_the_scan_ends_is_never_final_without_its_row(make_run, settings, monkeypatch):
    """The scan's ending and its ``deadline_enforced`` row commit together: a
    scan that fails before writing the row (its connection lost, its worker
    killed) leaves the run EXECUTING for the next scan, never final without
    the row. (The row used to follow the close, in a transaction of its own:
    a reader polling for the final state could find the run closed and the
    row not yet written.)"""
    settings.EXECGO_DEADLINE_GRACE_S = 3.0
    run = overdue_run(make_run, late_s=5, step_running=True)

    def connection_lost(*args, **kwargs):
        raise DatabaseError("server closed the connection unexpectedly")

    monkeypatch.setattr(deadlines, "audit", connection_lost)
    with pytest.raises(DatabaseError):
        scan_deadlines()
    run.refresh_from_db()
    assert run.state == "EXECUTING"
    assert Step.objects.get(run=run).run_status == StepRunStatus.RUNNING
    monkeypatch.undo()

    assert scan_deadlines() == [run.pk]
    run.refresh_from_db()
    assert run.state == "CLOSED_FAILED"
    assert AuditLog.objects.get(run_id=run.pk, event="deadline_enforced").data["forced"] is True
    assert timeout_row(run) == ("deadline scan", {"layer": "deadline_scan"})


def test_a_run_its_timer_ended_meanwhile_gets_no_row_of_the_scan(make_run):
    run = overdue_run(make_run, late_s=1)
    [found] = overdue_runs(timezone.now())
    settle_run(run.pk)  # the timer fires between the scan's query and its settle

    assert deadline_enforce(found, now=timezone.now()) is False

    assert not AuditLog.objects.filter(run_id=run.pk, event="deadline_enforced").exists()
    assert timeout_row(run) == ("run timer", {"layer": "harness"})
    assert final_audit_rows(Run.objects.get(pk=run.pk)) == ["run_failed"]


def test_the_run_timer_that_ends_a_run_is_named_by_its_timeout_row(make_run):
    """The timer's message (``settle_run`` at the deadline) ends an overdue
    run with no step running; its row says so, unlike a step's result
    settling the run past its deadline (the tool controller)."""
    run = overdue_run(make_run, late_s=1)

    settle_run(run.pk)  # the task's body, as the worker runs the timer

    run.refresh_from_db()
    assert (run.state, run.closing_cause) == ("CLOSED_FAILED", "run_timeout")
    assert timeout_row(run) == ("run timer", {"layer": "harness"})
    assert not AuditLog.objects.filter(run_id=run.pk, event="deadline_enforced").exists()
    assert final_audit_rows(run) == ["run_failed"]


def test_a_step_result_past_the_deadline_times_the_run_out_as_the_tool_controller(make_run):
    run = overdue_run(make_run, late_s=1, step_running=True)
    step = Step.objects.select_related("run").get(run=run)
    error = error_envelope(ErrorCode.TIMEOUT, "step exceeded its timeout", source="executor")

    step_finish(step, 1, failed_result(step.handle_id, error, attempt=1, started_at=time.time() - 3))

    run.refresh_from_db()
    assert (run.state, run.closing_cause) == ("CLOSED_FAILED", "run_timeout")
    assert timeout_row(run) == ("tool controller", {"layer": "harness"})
    assert not AuditLog.objects.filter(run_id=run.pk, event="deadline_enforced").exists()


def test_a_running_step_within_the_grace_is_left_to_its_own_timeout(make_run, settings):
    settings.EXECGO_DEADLINE_GRACE_S = 30.0
    run = overdue_run(make_run, late_s=1, step_running=True)

    assert scan_deadlines() == []

    run.refresh_from_db()
    assert run.state == "EXECUTING"
    assert Step.objects.get(run=run).run_status == StepRunStatus.RUNNING
    assert not AuditLog.objects.filter(run_id=run.pk, event="deadline_enforced").exists()


def test_a_run_before_its_deadline_and_runs_in_other_states_are_left_alone(make_run):
    running = make_run("EXECUTING", previous_state="POLICY_CHECK", timeout_s=600)
    waiting = make_run("AWAITING_HITL", previous_state="POLICY_CHECK",
                       last_state_change_at=timezone.now() - timedelta(hours=1))

    assert scan_deadlines() == []

    assert Run.objects.get(pk=running.pk).state == "EXECUTING"
    assert Run.objects.get(pk=waiting.pk).state == "AWAITING_HITL"


def test_the_run_timer_expires_so_a_parked_copy_is_dropped_when_it_comes_back(make_run):
    from runs.settle import executing_started
    from tests.runs.test_ledger_heal import queued

    purge_broker()
    run = make_run("EXECUTING", previous_state="POLICY_CHECK", timeout_s=30)
    executing_started(run)

    [timer] = queued("celery")
    assert (timer["task"], timer["args"]) == ("runs.tasks.settle_run", [run.pk])
    assert timer["eta"] is not None and timer["expires"] is not None
    assert timer["eta"] < timer["expires"]


def test_the_scan_is_on_beats_schedule():
    entry = settings.CELERY_BEAT_SCHEDULE["scan-run-deadlines"]
    assert entry["task"] == "runs.tasks.scan_run_deadlines"
    assert 0 < entry["schedule"] <= 5


def test_the_scan_ends_a_run_whose_worker_was_killed_holding_its_timer(api):
    """kill -9 of the worker (its whole process group: main process, pool)
    while the run's step runs. Another worker, on another host, runs the
    beat-driven scan; nothing re-attaches the step (its host has no worker
    left), so only the scan can end the run: forced after the grace, its
    step fenced, a ``deadline_enforced`` row and the timeout's own row
    naming the scan. The scan commits its row with the ending, so the rows
    are complete once the run is seen final.

    The other paths that end a run at its deadline are kept out, each for a
    reason of its own:

    - the step's own timeout (the shim's is the run's time left): with a
      6 s run timeout, a test process starved for that long between seeing
      the step running and the kill lets the doomed worker time the step
      and the run out itself (caller ``tool controller``, layer
      ``harness``, no ``deadline_enforced``). The run is submitted with a
      long timeout, and its deadline brought forward once its worker is
      dead;
    - the run's timer: the doomed worker's one prefetch slot holds the
      run's own task, so its timer is still queued when it dies; it is
      purged, lost as it is when a worker had taken it (Redis keeps it
      unacknowledged for CELERY_VISIBILITY_TIMEOUT, 4 h, which the suite
      leaves as it is; the filesystem broker loses it). Taken by the
      survivor it could not end the run anyway while the step is marked
      running;
    - the sweeper, whose EXECUTING row has no grace: its first sweep comes
      one interval after beat starts, an hour here;
    - the ledger heal and recovery at worker start judge only their own
      host's steps: the survivor's host has none."""
    purge_broker()
    env = {"EXECGO_DEADLINE_SCAN_INTERVAL_S": "1", "EXECGO_LEDGER_HEAL_INTERVAL_S": "1",
           "EXECGO_DEADLINE_GRACE_S": "2", "EXECGO_SWEEP_INTERVAL_S": "3600"}
    doomed = WorkerProcess(hostname="doomed", concurrency=1, env={**env, "EXECGO_HOST_NAME": "doomed-host"})
    survivor = WorkerProcess(hostname="survivor", concurrency=1, env={**env, "EXECGO_HOST_NAME": "survivor-host"})
    beat = BeatProcess(env)
    handles = []
    try:
        doomed.start()
        plan = {"steps": [{"id": "long", "tool": "shell", "timeout_s": 600, "params": {"argv": ["sleep", "300"]}}]}
        response = api.post("/api/v1/runs", {"title": "parked", "plan": plan, "timeout_s": 600}, format="json")
        assert response.status_code == 201, response.content
        run_id = response.json()["id"]
        wait_for_run(run_id, states={"EXECUTING"}, timeout=60)
        deadline_wait = time.monotonic() + 60
        while not (running := Step.objects.filter(run_id=run_id, run_status=StepRunStatus.RUNNING).first()):
            assert time.monotonic() < deadline_wait, log_tails(doomed)
            time.sleep(0.05)
        handles.append(running.handle_id)
        os.killpg(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.wait()
        doomed.log.close()
        doomed.proc = None
        purge_broker()  # the run's timer
        step = Step.objects.get(run_id=run_id)
        assert (Run.objects.get(pk=run_id).state, step.run_status, step.host) == (
            "EXECUTING", StepRunStatus.RUNNING, "doomed-host"), log_tails(doomed)
        survivor.start()
        beat.start()
        # The deadline passes in a second, its worker dead.
        started = Run.objects.get(pk=run_id).executing_started_at
        Run.objects.filter(pk=run_id).update(timeout_s=int((timezone.now() - started).total_seconds()) + 1)

        run = wait_for_run(run_id, states=FINAL, timeout=60)

        rows = list(AuditLog.objects.filter(run_id=run_id).order_by("pk").values_list("event", "caller", "data"))
        assert (run.state, run.closing_cause) == ("CLOSED_FAILED", "run_timeout"), rows
        assert run.finished_at - run.deadline < timedelta(seconds=30)  # a generous bound: scan 1 s + grace 2 s
        enforced = [data for event, _caller, data in rows if event == "deadline_enforced"]
        assert len(enforced) == 1 and enforced[0]["forced"] is True and enforced[0]["late_s"] >= 2, (
            rows, log_tails(survivor))
        [timeout] = [(caller, data) for event, caller, data in rows if event == "state_changed"
                     and data.get("layer") in ("harness", "deadline_scan", "sweeper")]
        assert timeout == ("deadline scan", {"layer": "deadline_scan"}), rows
        assert not {"zombie_detected", "zombie_recovered", "step_reattached"} & {row[0] for row in rows}, rows
        assert final_audit_rows(run) == ["run_failed"]
        step = Step.objects.get(run_id=run_id)
        assert (step.status, step.run_status) == (StepStatus.FAILED, StepRunStatus.CANCELLED)
    finally:
        beat.stop()
        stop_workers(doomed, survivor)
        purge_broker()
        for handle in handles:
            from runtime import attach

            attach.cancel(handle)
