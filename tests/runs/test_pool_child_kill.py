"""kill -9 of a Celery pool process in the middle of a step, ten times, on a
2-slot prefork worker while runs keep arriving: the worker is never
restarted, yet every run ends within its deadline + 60 s, no step runs
twice, the ledger ends at zero, reconciliation holds, and a graceful stop
(SIGTERM) of the worker then completes within its grace.

What heals it: the new pool process Celery starts in place of the dead
one sends a ledger heal (and beat sends one every second here), which
gives back the dead process's reservation, audits it and re-attaches its
step (the shim lived on in its own session) or re-delivers an attempt it
had not claimed yet. The beat-driven deadline scan is the backstop for
anything whose message died with the process (the filesystem broker
deletes a message when it is fetched).
"""

import os
import signal
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from django.conf import settings
from django.db import connection

from runs.models import AuditLog, Event, Run, Step
from runs.statemachine import FINAL
from runtime import forkserver, shim
from runtime.models import HostCapacity, Reservation
from tests.conftest import WorkerProcess, log_tails, purge_broker, token_client, wait_for_run, wait_until
from tests.reliability.checker import check_history
from tests.runs.test_deadline_scan import BeatProcess

pytestmark = pytest.mark.django_db(transaction=True)

HOST = "kill-host"
ENV = {"EXECGO_HOST_NAME": HOST, "EXECGO_TASK_SLOTS": "2", "EXECGO_DEADLINE_SCAN_INTERVAL_S": "1",
       "EXECGO_LEDGER_HEAL_INTERVAL_S": "1", "EXECGO_SWEEP_INTERVAL_S": "5",
       # A run killed between two stages (not in a step) is the sweeper's: quick here.
       "EXECGO_ZOMBIE_CREATED_S": "60", "EXECGO_ZOMBIE_PREPARING_S": "20", "EXECGO_ZOMBIE_PLANNING_S": "20",
       "EXECGO_ZOMBIE_POLICY_CHECK_S": "20", "EXECGO_ZOMBIE_TRACING_S": "20", "EXECGO_ZOMBIE_TRANSIENT_S": "20",
       # The pool process waits for its step itself: the process killed is one in the middle of a
       # step. (A step handed to the watcher costs nothing when its pool process dies:
       # tests/runs/test_step_watcher.py.)
       "EXECGO_STEP_HAND_OFF_S": "-1"}
KILLS = 10
RUN_TIMEOUT_S = 40
# Two slots drain a run (sleep 1, echo) about every second on a loaded
# machine: arrivals stay under that, so a run waits for its own faults only.
SUBMIT_EVERY_S = 1.5
STOP_GRACE_S = 20  # the harness's stop waits this long before SIGKILL (tests/conftest.py)
PLAN = {"steps": [{"id": "nap", "tool": "shell", "timeout_s": 20, "params": {"argv": ["sleep", "1"]}},
                  {"id": "say", "tool": "shell", "timeout_s": 20, "depends_on": ["nap"],
                   "params": {"argv": ["echo", "ran"]}}]}


def pool_processes(main: psutil.Process) -> set[int]:
    pids = set()
    for child in main.children():
        try:
            if "celery" in " ".join(child.cmdline()):
                pids.add(child.pid)
        except psutil.Error:
            continue  # a killed one not reaped yet, or gone
    return pids


def busy_pool_processes(main: psutil.Process, host: str = HOST) -> set[int]:
    """The pool processes of ``main`` holding the slot of a step whose command runs now."""
    pool = pool_processes(main)
    return {owner for handle_id, owner in Reservation.objects.filter(host_id=host).values_list("handle_id", "owner_pid")
            if owner in pool and (Path(settings.EXECGO_TASKS_DIR) / handle_id / shim.SHIM_FILE).exists()}


def busy_pool_process(main: psutil.Process) -> int | None:
    """A pool process of ``main`` holding the slot of a step whose command runs now."""
    pool = pool_processes(main)
    for handle_id, owner in Reservation.objects.filter(host_id=HOST).values_list("handle_id", "owner_pid"):
        if owner in pool and (Path(settings.EXECGO_TASKS_DIR) / handle_id / shim.SHIM_FILE).exists():
            return owner
    return None


def launched_attempts(step: Step) -> int:
    """Attempts of ``step`` (every handle its events name) whose command was
    launched: a shim record in their task directory."""
    handles = set(Event.objects.filter(run_id=step.run_id, task_id=step.step_id).exclude(handle_id="")
                  .values_list("handle_id", flat=True))
    return sum(1 for handle in handles if (Path(settings.EXECGO_TASKS_DIR) / handle / shim.SHIM_FILE).exists())


def describe(run: Run) -> str:
    """What happened to a run that did not succeed (for a failure message)."""
    steps = list(Step.objects.filter(run=run).values_list("step_id", "status", "run_status", "attempt"))
    events = [f"{event.type}:{event.task_id}:{event.message[:60]}" for event in run.events.order_by("pk")]
    audits = list(AuditLog.objects.filter(run_id=run.pk).values_list("event", "caller"))
    return f"run {run.pk} {run.state} ({run.closing_cause}) steps={steps} events={events[-10:]} audit={audits}"


class Submitter(threading.Thread):
    """Runs keep arriving, over the API, until stopped."""

    def __init__(self, agent):
        super().__init__(daemon=True)
        self.agent, self.run_ids, self.errors, self.done = agent, [], [], threading.Event()

    def run(self):
        client = token_client(self.agent)
        try:
            while not self.done.is_set():
                response = client.post("/api/v1/runs", {"title": f"k-{len(self.run_ids)}", "plan": PLAN,
                                                        "timeout_s": RUN_TIMEOUT_S}, format="json")
                if response.status_code != 201:
                    self.errors.append(response.content)
                else:
                    self.run_ids.append(response.json()["id"])
                self.done.wait(SUBMIT_EVERY_S)
        finally:
            connection.close()


def test_ten_pool_process_kills_mid_step_on_a_two_slot_worker(agent, tmp_path):
    purge_broker()
    worker = WorkerProcess(hostname="kills", concurrency=2, env=ENV)
    beat = BeatProcess(ENV)
    submitter = Submitter(agent)
    killed = []
    try:
        worker.start()
        beat.start()
        main = psutil.Process(worker.proc.pid)
        submitter.start()
        started = time.monotonic()
        while len(killed) < KILLS:
            assert time.monotonic() - started < 90, f"only {len(killed)} kills{log_tails(worker)}"
            victim = busy_pool_process(main)
            if victim is None:
                time.sleep(0.05)
                continue
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)
            # Celery replaces it; the next victim is another process.
            wait_until(lambda: len(pool_processes(main) - set(killed)) == 2, timeout=30,
                       what="a new pool process")
            time.sleep(0.7)
        submitter.done.set()
        submitter.join(timeout=30)
        assert submitter.errors == []
        run_ids = submitter.run_ids

        wait_until(lambda: Run.objects.filter(pk__in=run_ids, state__in=FINAL).count() == len(run_ids),
                   timeout=RUN_TIMEOUT_S + 60, what="every run final")
        wait_until(lambda: not Reservation.objects.filter(host_id=HOST).exists(), timeout=30,
                   what="the ledger back at zero")

        stopping = time.monotonic()
        os.kill(worker.proc.pid, signal.SIGTERM)
        try:
            returncode = worker.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the worker did not stop within {STOP_GRACE_S}s of SIGTERM{log_tails(worker)}")
        stop_s = time.monotonic() - stopping
        assert returncode == 0
    except (AssertionError, pytest.fail.Exception) as exc:
        raise AssertionError(f"{exc}{log_tails(worker, size=6000)}") from exc
    finally:
        submitter.done.set()
        beat.stop()
        worker.stop()
        forkserver.stop_server(str(settings.EXECGO_TASKS_DIR))
        purge_broker()

    runs = list(Run.objects.filter(pk__in=run_ids))
    outcome = {state: sum(1 for run in runs if run.state == state) for state in {run.state for run in runs}}
    late = max((run.finished_at - (run.deadline or run.created_at)).total_seconds() for run in runs)
    reclaims = AuditLog.objects.filter(event="reservation_reclaimed").count()
    print(f"\n{len(runs)} runs, {len(killed)} pool processes killed, {reclaims} reservations reclaimed: {outcome}; "
          f"latest end vs deadline {late:+.1f}s; SIGTERM to exit {stop_s:.1f}s")

    assert all(run.state in FINAL for run in runs)
    for run in runs:  # every run final within its deadline + 60 s
        assert run.finished_at <= (run.deadline or run.created_at + timedelta(seconds=RUN_TIMEOUT_S)) + timedelta(
            seconds=60), run
    # The ledger at zero; only dead processes' slots were reclaimed (each audited), most of the
    # killed ones' so (a killed re-attachment's slot is adopted by its re-delivery instead,
    # and a victim may have released its slot between being picked and killed).
    capacity = HostCapacity.objects.get(host=HOST)
    assert (capacity.task_slots_reserved, capacity.memory_bytes_reserved, capacity.pids_reserved) == (0, 0, 0)
    reclaimed_owners = set(AuditLog.objects.filter(event="reservation_reclaimed").values_list("data__owner_pid",
                                                                                             flat=True))
    assert reclaimed_owners <= set(killed)
    assert len(reclaimed_owners) >= KILLS // 2, (reclaimed_owners, killed)
    # No step ran twice: at most one launched attempt per step, exactly one for a step that succeeded.
    for step in Step.objects.filter(run_id__in=run_ids):
        assert launched_attempts(step) <= 1, step
        if step.status == "success":
            assert launched_attempts(step) == 1, step
    # A killed process's step was re-attached and ran on: most runs succeed.
    assert outcome.get("SUCCEEDED", 0) >= len(runs) * 0.9, [describe(run) for run in runs if run.state != "SUCCEEDED"]
    assert check_history(run_ids, grace_s=60, export_dir=tmp_path) == []  # reconcile's invariants included


def test_a_host_full_of_live_reservations_never_blocks_the_pool(api):
    """Every slot held by a live process that never gives it back: the
    attempt goes back to the queue again and again (visibly), the pool stays
    free to run the run's deadline timer, the run ends at its deadline, and
    SIGTERM stops the worker at once (before, both pool processes slept in
    the ledger with no bound and the stop hung)."""
    from runtime import ledger

    purge_broker()
    host = "full-host"
    env = {"EXECGO_HOST_NAME": host, "EXECGO_TASK_SLOTS": "1", "EXECGO_LEDGER_WAIT_S": "0.5",
           "EXECGO_LEDGER_REQUEUE_S": "0.5"}
    worker = WorkerProcess(hostname="full", concurrency=2, env=env)
    try:
        worker.start()
        # Past the worker's recovery, which rebuilds the ledger from the steps running on it.
        wait_until(lambda: b"recovery on full-host" in worker.log_path.read_bytes(), what="the worker's recovery")
        assert ledger.reserve(host, "h-squatter")  # this test process: alive, never releases
        plan = {"steps": [{"id": "a", "tool": "shell", "params": {"argv": ["true"]}}]}
        response = api.post("/api/v1/runs", {"title": "full", "plan": plan, "timeout_s": 5}, format="json")
        assert response.status_code == 201, response.content
        run_id = response.json()["id"]

        wait_until(lambda: Run.objects.get(pk=run_id).state in FINAL, timeout=60, what="the run final")

        run = Run.objects.get(pk=run_id)
        assert (run.state, run.closing_cause) == ("CLOSED_FAILED", "run_timeout")
        assert run.finished_at - run.deadline < timedelta(seconds=15)  # generous: the timer fires at the deadline
        requeued = Event.objects.filter(run_id=run_id, type="task_progressed", data__requeued=True).count()
        assert requeued >= 2
        step = Step.objects.get(run_id=run_id)
        # Cancelled while queued, or claimed just past the deadline and ended unstarted: never launched.
        assert step.run_status in ("cancelled", "failed"), step.result
        assert not (Path(settings.EXECGO_TASKS_DIR) / step.handle_id / shim.SHIM_FILE).exists()
        assert list(Reservation.objects.filter(host_id=host).values_list("handle_id", flat=True)) == ["h-squatter"]

        stopping = time.monotonic()
        os.kill(worker.proc.pid, signal.SIGTERM)
        try:
            assert worker.proc.wait(timeout=STOP_GRACE_S) == 0
        except subprocess.TimeoutExpired:
            pytest.fail(f"the worker did not stop within {STOP_GRACE_S}s of SIGTERM{log_tails(worker)}")
        print(f"\nfull host: {requeued} re-queues before the deadline; SIGTERM to exit "
              f"{time.monotonic() - stopping:.1f}s")
    except (AssertionError, pytest.fail.Exception) as exc:
        raise AssertionError(f"{exc}{log_tails(worker)}") from exc
    finally:
        worker.stop()
        ledger.release("h-squatter")
        purge_broker()


def test_a_worker_whose_pool_processes_die_mid_step_takes_new_work_within_seconds(api):
    """Both pool processes of a -c 2 worker killed in the middle of their
    steps: the worker declares their jobs lost after CELERY_WORKER_LOST_WAIT
    (1 s), which frees its prefetch for the next message. Celery's default
    waits 10 s, and the worker took no message at all meanwhile."""
    purge_broker()
    host = "lost-host"
    worker = WorkerProcess(hostname="lost", concurrency=2, env={
        "EXECGO_HOST_NAME": host, "EXECGO_TASK_SLOTS": "4", "EXECGO_STEP_HAND_OFF_S": "-1"})
    nap = {"steps": [{"id": "nap", "tool": "shell", "params": {"argv": ["sleep", "2"]}}]}
    quick = {"steps": [{"id": "a", "tool": "shell", "params": {"argv": ["true"]}}]}
    try:
        worker.start()
        main = psutil.Process(worker.proc.pid)
        naps = [api.post("/api/v1/runs", {"title": f"nap-{n}", "plan": nap}, format="json").json()["id"]
                for n in range(2)]
        wait_until(lambda: len(busy_pool_processes(main, host)) == 2, what="both pool processes in a step")
        victims = busy_pool_processes(main, host)
        for victim in victims:
            os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        response = api.post("/api/v1/runs", {"title": "quick", "plan": quick}, format="json")
        assert response.status_code == 201, response.content
        run = wait_for_run(response.json()["id"], timeout=60)
        took = time.monotonic() - killed_at
        assert run.state == "SUCCEEDED", run.state
        # Generous: about 3 s here (a second's wait, then the killed steps' re-attachments).
        assert took < 8, f"the quick run took {took:.1f}s after the kills{log_tails(worker)}"
        for run_id in naps:  # re-attached and ended on their own
            assert wait_for_run(run_id, timeout=60).state == "SUCCEEDED"
    finally:
        worker.stop()
        purge_broker()


def test_idle_pool_processes_killed_while_they_wait_for_a_task_leave_the_worker_working(api):
    """kill -9 of each idle pool process of a -c 2 worker, one after the
    other: the worker starts new ones and runs the next run. On the embedded
    broker the worker once used billiard's threaded pool, whose idle
    processes wait for a task on one shared pipe under one shared lock; the
    one killed while holding it (waiting in its read) took the lock with it,
    and the worker never ran a task again (`execgo.broker.Transport`)."""
    purge_broker()
    host = "idle-host"
    worker = WorkerProcess(hostname="idle", concurrency=2, env={"EXECGO_HOST_NAME": host})
    quick = {"steps": [{"id": "a", "tool": "shell", "params": {"argv": ["true"]}}]}
    try:
        worker.start()
        main = psutil.Process(worker.proc.pid)
        first = api.post("/api/v1/runs", {"title": "before", "plan": quick}, format="json").json()["id"]
        assert wait_for_run(first, timeout=60).state == "SUCCEEDED"
        wait_until(lambda: not Reservation.objects.filter(host_id=host).exists(), what="the pool idle")
        originals = pool_processes(main)
        assert len(originals) == 2
        for victim in originals:  # whichever of them waits in the read, it is killed
            os.kill(victim, signal.SIGKILL)
            wait_until(lambda victim=victim: victim not in pool_processes(main) and len(pool_processes(main)) == 2,
                       what="a new pool process in its place")
        response = api.post("/api/v1/runs", {"title": "after", "plan": quick}, format="json")
        assert response.status_code == 201, response.content
        run = wait_for_run(response.json()["id"], timeout=60)
        assert run.state == "SUCCEEDED", f"{run.state}{log_tails(worker)}"
        assert not pool_processes(main) & originals
    finally:
        worker.stop()
        purge_broker()
