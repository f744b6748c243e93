"""A ledger that heals: a reservation belongs to a live process (pid and
start time, on its host); one whose process is gone is given back, audited,
and its step re-attached (running) or re-delivered (accepted), without a
worker restart. A step that finds its host full waits a bounded time, then
goes back to the queue with a countdown, still accepted, never failed."""

import subprocess
import sys
import time

import psutil
import pytest
from django.conf import settings

from runs.dataplane import current_host, host_queue, new_handle_id
from runs.execution import step_execute
from runs.ledger_heal import ledger_heal
from runs.models import AuditLog, Event, EventType, Run, Step, StepRunStatus, StepStatus
from runs.tasks import heal_ledgers
from runs.worker_start import hosts_to_heal
from runtime import layout, ledger
from runtime.models import HostCapacity, Reservation
from tests.conftest import ROOT, _worker_env, purge_broker, wait_until
from tests.runs.conftest import start_attempt

pytestmark = pytest.mark.django_db(transaction=True)


def queued(queue: str) -> list[dict]:
    """Take every message waiting in ``queue``: task name, args, eta, expiry."""
    from execgo.celery import app

    messages = []
    with app.connection_for_read() as connection:
        simple = connection.SimpleQueue(queue, no_ack=True)
        try:
            while True:
                try:
                    message = simple.get(timeout=1.0)
                except simple.Empty:
                    break
                messages.append({"task": message.headers.get("task"), "args": message.payload[0],
                                 "eta": message.headers.get("eta"), "expires": message.headers.get("expires")})
        finally:
            simple.close()
    return messages


@pytest.fixture
def host(db):
    purge_broker()
    yield ledger.host_register(current_host(), task_slots=2, memory_bytes=2**30, pids=4096).host
    purge_broker()


def a_step(make_run, *, run_status: str = StepRunStatus.RUNNING) -> Step:
    run = make_run("EXECUTING", timeout_s=60)
    step = Step.objects.create(run=run, step_id="a", position=0, tool="shell", params={"argv": ["true"]},
                               timeout_s=5, retries=0)
    if run_status == StepRunStatus.RUNNING:
        return start_attempt(step)
    Step.objects.filter(pk=step.pk).update(run_status=StepRunStatus.ACCEPTED, attempt=1,
                                           handle_id=new_handle_id(step, 1))
    return Step.objects.select_related("run").get(pk=step.pk)


def reserve_in_another_process(host: str, handle_id: str) -> int:
    """A real process (as a pool process would) reserves ``handle_id`` and
    exits without releasing it; returns its pid."""
    code = ("import django; django.setup(); from runtime import ledger; "
            f"assert ledger.reserve({host!r}, {handle_id!r})")
    env = {**_worker_env(), "DJANGO_SETTINGS_MODULE": "execgo.settings"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    return Reservation.objects.get(handle_id=handle_id).owner_pid


def launched(step: Step) -> bool:
    return (layout.task_dir(step.handle_id) / "shim.json").exists()


def slots_reserved(host: str) -> int:
    return HostCapacity.objects.get(host=host).task_slots_reserved


def test_a_reservation_whose_process_died_is_reclaimed_audited_and_its_step_reattached(host, make_run):
    step = a_step(make_run)
    pid = reserve_in_another_process(host, step.handle_id)
    assert slots_reserved(host) == 1
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

    reclaimed = ledger_heal()

    assert [row["handle_id"] for row in reclaimed] == [step.handle_id]
    assert not Reservation.objects.filter(handle_id=step.handle_id).exists()
    assert slots_reserved(host) == 0
    row = AuditLog.objects.get(event="reservation_reclaimed")
    assert (row.run_id, row.tenant_id, row.caller) == (step.run_id, step.run.tenant_id, "ledger heal")
    assert row.data["owner_pid"] == pid
    assert (row.data["reason"], row.data["then"], row.data["step"]) == ("owner_gone", "reattached", "a")
    assert [(m["task"], m["args"]) for m in queued(host_queue(host))] == [
        ("runs.tasks.reattach_step", [step.pk, 1])]
    # Healed once: a second heal finds nothing to give back.
    assert ledger_heal() == []
    assert AuditLog.objects.filter(event="reservation_reclaimed").count() == 1


def test_an_accepted_attempt_whose_process_died_before_claiming_is_delivered_again(host, make_run):
    step = a_step(make_run, run_status=StepRunStatus.ACCEPTED)
    reserve_in_another_process(host, step.handle_id)

    ledger_heal()

    assert slots_reserved(host) == 0
    assert AuditLog.objects.get(event="reservation_reclaimed").data["then"] == "redelivered"
    assert [(m["task"], m["args"]) for m in queued("celery")] == [("runs.tasks.execute_step", [step.pk, 1])]


def test_a_pid_reused_by_another_process_is_still_recognised_as_dead(host):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        started_at = ledger.process_started_at(sleeper.pid)
        assert ledger.reserve(host, "h-reused") and ledger.reserve(host, "h-same")
        # "h-reused" was made by an earlier process that had the same pid.
        Reservation.objects.filter(handle_id="h-reused").update(owner_pid=sleeper.pid,
                                                               owner_started_at=started_at - 30.0)
        Reservation.objects.filter(handle_id="h-same").update(owner_pid=sleeper.pid, owner_started_at=started_at)
        assert ledger.owner_alive(sleeper.pid, started_at) is True
        assert ledger.owner_alive(sleeper.pid, started_at - 30.0) is False

        reclaimed = ledger.reclaim(host)

        assert [row["handle_id"] for row in reclaimed] == ["h-reused"]
        assert list(Reservation.objects.values_list("handle_id", flat=True)) == ["h-same"]
        assert slots_reserved(host) == 1
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_zombie_owner_is_dead(host):
    child = subprocess.Popen(["true"])  # exits at once; not waited for, it stays a zombie
    wait_until(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, what="a zombie")
    try:
        assert ledger.reserve(host, "h-zombie")
        Reservation.objects.filter(handle_id="h-zombie").update(
            owner_pid=child.pid, owner_started_at=ledger.process_started_at(child.pid))

        assert [row["handle_id"] for row in ledger.reclaim(host)] == ["h-zombie"]
        assert slots_reserved(host) == 0
    finally:
        child.wait()


def test_a_live_owner_keeps_its_reservation(host):
    assert ledger.reserve(host, "h-mine")
    assert Reservation.objects.get(handle_id="h-mine").owner_pid == ledger.current_owner()[0]

    assert ledger.reclaim(host) == []
    assert slots_reserved(host) == 1


def test_setting_the_wall_clock_does_not_make_a_live_owner_look_dead(host, monkeypatch):
    """An owner is named by its start in seconds after boot. In seconds since
    the epoch it would move with the kernel's btime whenever the clock is set
    or slewed past a second, and every live owner would look like a reused pid
    (a CI run lost its own reservations so)."""
    assert ledger.reserve(host, "h-mine")
    pid, started_at = ledger.current_owner()
    assert 0 < started_at <= time.clock_gettime(time.CLOCK_BOOTTIME)
    btime = psutil.boot_time()
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: btime + 1.0)  # the clock stepped a second on

    assert ledger.owner_alive(pid, started_at)
    assert ledger.reclaim(host) == []


def test_a_reservation_kept_for_a_live_shim_is_adopted_or_reclaimed_once_nothing_wants_it(host, make_run):
    step = a_step(make_run)
    assert ledger.reserve(host, step.handle_id) and ledger.reserve(host, "h-forgotten")
    ledger.recover(host, keep=lambda handle: True)  # a worker start: what it keeps waits, unowned
    assert set(Reservation.objects.values_list("owner_pid", flat=True)) == {None}

    assert ledger.reserve(host, step.handle_id)  # the re-attachment adopts its slot
    assert Reservation.objects.get(handle_id=step.handle_id).owner_pid == ledger.current_owner()[0]
    assert slots_reserved(host) == 2
    Reservation.objects.filter(handle_id="h-forgotten").update(
        reserved_at=Reservation.objects.get(handle_id="h-forgotten").reserved_at.replace(year=2000))

    reclaimed = ledger_heal()

    assert [(row["handle_id"], row["reason"]) for row in reclaimed] == [("h-forgotten", "unowned")]
    assert list(Reservation.objects.values_list("handle_id", flat=True)) == [step.handle_id]
    assert slots_reserved(host) == 1


def test_a_full_host_sends_the_attempt_back_to_the_queue_after_a_bounded_wait(host, make_run, settings):
    settings.EXECGO_LEDGER_WAIT_S = 0.3
    settings.EXECGO_LEDGER_REQUEUE_S = 2.0
    assert ledger.reserve(host, "h-busy-1") and ledger.reserve(host, "h-busy-2")  # held by this live process
    step = a_step(make_run, run_status=StepRunStatus.ACCEPTED)

    started = time.monotonic()
    assert step_execute(step.pk, 1) is None
    assert time.monotonic() - started < 30  # bounded (a generous bound: the wait is 0.3 s)

    step.refresh_from_db()
    assert (step.status, step.run_status, step.attempt) == (StepStatus.PENDING, StepRunStatus.ACCEPTED, 1)
    assert not Reservation.objects.filter(handle_id=step.handle_id).exists()
    requeued = Event.objects.get(run_id=step.run_id, type=EventType.TASK_PROGRESSED)
    assert requeued.data["requeued"] is True and requeued.data["waiting_for"] == "resources"
    assert 1.0 <= requeued.data["countdown_s"] <= 3.0
    assert requeued.data["waited_ms"] >= 300
    [message] = queued("celery")
    assert (message["task"], message["args"]) == ("runs.tasks.execute_step", [step.pk, 1])
    assert message["eta"] is not None  # sent with a countdown, not at once

    # Once a slot is free the re-delivered attempt runs.
    ledger.release("h-busy-1")
    step_execute(step.pk, 1)
    step.refresh_from_db()
    assert (step.status, step.run_status) == (StepStatus.SUCCESS, StepRunStatus.SUCCESS)
    assert slots_reserved(host) == 1  # h-busy-2 only


def test_a_slot_of_a_dead_process_is_reclaimed_when_a_step_needs_it(host, make_run, settings):
    settings.EXECGO_LEDGER_WAIT_S = 0.2
    leaked = [reserve_in_another_process(host, f"h-leaked-{index}") for index in range(2)]
    assert slots_reserved(host) == 2
    step = a_step(make_run, run_status=StepRunStatus.ACCEPTED)

    step_execute(step.pk, 1)

    step.refresh_from_db()
    assert (step.status, step.run_status) == (StepStatus.SUCCESS, StepRunStatus.SUCCESS)
    assert sorted(AuditLog.objects.filter(event="reservation_reclaimed").values_list("data__owner_pid", flat=True)
                  ) == sorted(leaked)
    assert slots_reserved(host) == 0
    assert not Event.objects.filter(run_id=step.run_id, type=EventType.TASK_PROGRESSED).exists()


def test_a_duplicate_delivery_does_not_give_back_the_running_attempts_slot(host, make_run):
    step = a_step(make_run)
    assert ledger.reserve(host, step.handle_id)

    assert step_execute(step.pk, 1) is None  # the attempt is running: the duplicate finds no claim

    assert Reservation.objects.filter(handle_id=step.handle_id).exists()
    assert slots_reserved(host) == 1


def test_settings_bound_the_wait():
    assert 0 < settings.EXECGO_LEDGER_WAIT_S <= 10
    assert settings.CELERY_BEAT_SCHEDULE["heal-ledgers"]["task"] == "runs.tasks.heal_ledgers"


def test_a_run_whose_process_died_closing_it_is_closed_by_the_heal(host, make_run):
    run = make_run("TRACING", previous_state="EXECUTING", closing_cause="succeeded")
    step = Step.objects.create(run=run, step_id="a", position=0, tool="shell", params={"argv": ["true"]},
                               timeout_s=5, status=StepStatus.SUCCESS, run_status=StepRunStatus.SUCCESS, attempt=1,
                               handle_id="h-closing-1", host=host)
    reserve_in_another_process(host, step.handle_id)  # a finished step's slot is given back after the close

    ledger_heal()

    run.refresh_from_db()
    assert run.state == "SUCCEEDED"
    assert AuditLog.objects.get(event="reservation_reclaimed").data["then"] == "closed"
    assert AuditLog.objects.filter(run_id=run.pk, event="run_succeeded").count() == 1
    assert slots_reserved(host) == 0


def test_a_step_asking_for_more_than_the_host_has_is_refused_not_requeued_for_ever(host, make_run):
    """An agent cannot park an attempt in the queue (or a pool process in
    the ledger) by asking for more memory than the host will ever have (within the
    limit caps: 2 GiB on a host registered with 1 GiB)."""
    step = a_step(make_run, run_status=StepRunStatus.ACCEPTED)
    Step.objects.filter(pk=step.pk).update(requested_plan={"limits": {"address_space_bytes": 2**31}})

    assert step_execute(step.pk, 1) is None

    step.refresh_from_db()
    assert (step.status, step.run_status) == (StepStatus.FAILED, StepRunStatus.FAILED)
    assert step.result["error"]["code"] == "invalid_input"
    assert step.result["error"]["retryable"] is False
    assert "exceeds the capacity" in step.result["error"]["message"]
    assert not Event.objects.filter(run_id=step.run_id, type=EventType.TASK_PROGRESSED).exists()
    assert queued("celery") == []
    assert slots_reserved(host) == 0


def test_beat_heals_the_hosts_seen_lately_and_a_heal_says_its_host_is_alive(host):
    gone = ledger.host_register("gone-host", task_slots=1, memory_bytes=2**30, pids=10)
    HostCapacity.objects.filter(host__in=[host, gone.host]).update(last_seen=gone.last_seen.replace(year=2000))

    ledger_heal()  # on this host

    assert HostCapacity.objects.get(host=host).last_seen.year > 2000
    assert hosts_to_heal() == [host]
    heal_ledgers()
    [message] = queued(host_queue(host))
    assert message["task"] == "runs.tasks.heal_host" and message["expires"] is not None
    assert queued(host_queue("gone-host")) == []


def test_an_attempt_delivered_after_the_deadline_never_runs_without_a_slot(host, make_run):
    assert ledger.reserve(host, "h-busy-1") and ledger.reserve(host, "h-busy-2")  # the host is full
    step = a_step(make_run, run_status=StepRunStatus.ACCEPTED)
    Run.objects.filter(pk=step.run_id).update(executing_started_at=step.run.executing_started_at.replace(year=2000))

    step_execute(step.pk, 1)

    step.refresh_from_db()
    assert (step.status, step.run_status) == (StepStatus.FAILED, StepRunStatus.FAILED)
    assert step.result["error"]["code"] == "timeout"
    assert "deadline passed before the step started" in step.result["error"]["message"]
    assert launched(step) is False
    assert slots_reserved(host) == 2
