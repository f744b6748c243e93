"""The zombie sweeper against docs/sweeper.md#thresholds-and-forced-paths:
every stuck state is forced along its listed path to a final state, and a
run under its threshold is left alone."""

import os
from dataclasses import dataclass
from datetime import timedelta

import pytest
from django.conf import settings as django_settings
from django.utils import timezone

from runs.invariants import find_violations
from runs.models import AuditLog, Dispatch, Job, Run, Step, Trace
from runs.statemachine import ZOMBIE_SWEEPER
from runs.sweeper import RESENDABLE, sweep_run, sweep_zombies
from runs.transitions import run_transition

transactional = pytest.mark.django_db(transaction=True)

# docs/state-machine.md#job-status-projection, so the runs the factory
# places are consistent with their jobs.
JOB_STATUS = {
    "CREATED": "pending", "PREPARING": "pending", "PLANNING": "pending", "POLICY_CHECK": "pending",
    "AWAITING_HITL": "running", "EXECUTING": "running", "TRACING": "running",
    "REJECTED": "running", "FAILED": "running", "TIMEOUT": "running", "CANCELLED": "running",
}

FINAL_AUDIT_EVENT = {
    "SUCCEEDED": "run_succeeded",
    "CLOSED_REJECTED": "run_rejected",
    "CLOSED_FAILED": "run_failed",
    "CLOSED_CANCELLED": "run_cancelled",
}

APPROVAL_TIMEOUT_S = 120
RUN_TIMEOUT_S = 600


@dataclass(frozen=True)
class Row:
    """One row of docs/sweeper.md#thresholds-and-forced-paths (transient
    states split by what decides their final state)."""

    state: str
    path: tuple[str, ...]  # states the sweeper takes the run through
    previous_state: str = ""
    closing_cause: str = ""

    @property
    def final(self) -> str:
        return self.path[-1]

    def __str__(self) -> str:
        return f"{self.state}{'<-' + self.previous_state if self.previous_state else ''}"


EXPECTED_ROWS = [
    Row("CREATED", ("FAILED", "TRACING", "CLOSED_FAILED")),
    Row("PREPARING", ("FAILED", "TRACING", "CLOSED_FAILED"), previous_state="CREATED"),
    Row("PLANNING", ("TIMEOUT", "TRACING", "CLOSED_FAILED"), previous_state="PREPARING"),
    Row("POLICY_CHECK", ("FAILED", "TRACING", "CLOSED_FAILED"), previous_state="PLANNING"),
    Row("AWAITING_HITL", ("TIMEOUT", "TRACING", "CLOSED_REJECTED"), previous_state="POLICY_CHECK"),
    Row("EXECUTING", ("TIMEOUT", "TRACING", "CLOSED_FAILED"), previous_state="POLICY_CHECK"),
    # A trace write failed: even a run that was about to succeed closes as failed.
    Row("TRACING", ("FAILED", "TRACING", "CLOSED_FAILED"), previous_state="EXECUTING", closing_cause="succeeded"),
    Row("REJECTED", ("TRACING", "CLOSED_REJECTED"), previous_state="POLICY_CHECK"),
    Row("FAILED", ("TRACING", "CLOSED_FAILED"), previous_state="EXECUTING"),
    Row("TIMEOUT", ("TRACING", "CLOSED_REJECTED"), previous_state="AWAITING_HITL"),
    Row("TIMEOUT", ("TRACING", "CLOSED_FAILED"), previous_state="PLANNING"),
    Row("TIMEOUT", ("TRACING", "CLOSED_FAILED"), previous_state="EXECUTING"),
    Row("CANCELLED", ("TRACING", "CLOSED_CANCELLED"), previous_state="EXECUTING"),
]



def threshold_s(state: str) -> int:
    if state == "AWAITING_HITL":
        return APPROVAL_TIMEOUT_S
    if state == "EXECUTING":
        return RUN_TIMEOUT_S
    thresholds = django_settings.EXECGO_ZOMBIE_THRESHOLDS_S
    return thresholds.get(state, thresholds["TRANSIENT"])


def place(make_run, row: Row, *, age_s: float, resends: int | None = None) -> Run:
    """A run that has sat in ``row.state`` for ``age_s`` seconds; where the
    sweeper first sends a run's work again, it has done so ``resends``
    times (default: as often as it does, so this sweep forces it)."""
    since = timezone.now() - timedelta(seconds=age_s)
    if resends is None:
        resends = django_settings.EXECGO_SWEEP_RESENDS if row.state in RESENDABLE | {"EXECUTING"} else 0
    run = make_run(
        row.state, previous_state=row.previous_state, closing_cause=row.closing_cause,
        last_state_change_at=since, executing_started_at=since if row.state == "EXECUTING" else None,
        approval_timeout_s=APPROVAL_TIMEOUT_S, timeout_s=RUN_TIMEOUT_S, resends=resends,
    )
    Job.objects.filter(pk=run.job_id).update(status=JOB_STATUS[row.state])
    return run


def transitions_of(run: Run) -> list[tuple[str, str]]:
    return list(Trace.objects.filter(run=run, kind="transition").values_list("from_state", "to_state"))


def assert_recovered(run: Run, row: Row) -> None:
    fresh = Run.objects.get(pk=run.pk)
    assert fresh.state == row.final, f"{row}: ended {fresh.state}"
    states = [row.state, *row.path]
    assert transitions_of(run) == list(zip(states, states[1:]))

    audit = list(AuditLog.objects.filter(run_id=run.pk).order_by("id"))
    events = [entry.event for entry in audit]
    assert events[0] == "zombie_detected"
    assert events[-1] == "zombie_recovered"
    assert events.count(FINAL_AUDIT_EVENT[row.final]) == 1
    assert not set(events) & (set(FINAL_AUDIT_EVENT.values()) - {FINAL_AUDIT_EVENT[row.final]})
    detected, recovered = audit[0], audit[-1]
    assert (detected.forced_by, detected.from_state) == (ZOMBIE_SWEEPER, row.state)
    assert detected.data["age_s"] > threshold_s(row.state)
    assert (recovered.forced_by, recovered.from_state, recovered.to_state) == (
        ZOMBIE_SWEEPER, row.state, row.final,
    )
    if row.state not in ("REJECTED", "FAILED", "TIMEOUT", "CANCELLED"):
        # The edge out of the stuck state says who forced it (the AuditLog
        # tells the sweeper from the run's own timer:
        # docs/sweeper.md#other-fallbacks).
        forced = audit[1]
        assert (forced.event, forced.from_state, forced.to_state, forced.forced_by) == (
            "state_changed", row.state, row.path[0], ZOMBIE_SWEEPER,
        )
        # The key trace (docs/state-machine.md#what-each-failure-becomes): an
        # expired approval is a HITLDecisionTrace (timeout, default reject);
        # anything else stuck is a RunTrace.
        kind = "hitl_decision" if row.state == "AWAITING_HITL" else "run"
        key_trace = Trace.objects.get(run=run, kind=kind, from_state=row.state, to_state=row.path[0])
        assert key_trace.data["layer"] == "sweeper"
        assert key_trace.error["code"] == ("timeout" if row.path[0] == "TIMEOUT" else "internal")
        if kind == "hitl_decision":
            assert (key_trace.data["decision"], key_trace.data["timeout"]) == ("reject", True)
    assert Job.objects.get(pk=run.job_id).status == ("done" if row.final == "SUCCEEDED" else "failed")


@transactional
@pytest.mark.parametrize("row", EXPECTED_ROWS, ids=str)
def test_stuck_run_is_forced_to_its_final_state(make_run, row):
    stuck = place(make_run, row, age_s=threshold_s(row.state) + 5)
    fresh = place(make_run, row, age_s=threshold_s(row.state) - 10)

    assert sweep_zombies() == [stuck.pk]

    assert_recovered(stuck, row)
    untouched = Run.objects.get(pk=fresh.pk)
    assert (untouched.state, untouched.last_state_change_at) == (row.state, fresh.last_state_change_at)
    assert not AuditLog.objects.filter(run_id=fresh.pk).exists()
    assert not Trace.objects.filter(run=fresh).exists()
    assert find_violations() == []


@transactional
def test_one_sweep_recovers_every_stuck_run_and_only_those(make_run):
    stuck = [place(make_run, row, age_s=threshold_s(row.state) + 5) for row in EXPECTED_ROWS]
    fresh = [place(make_run, row, age_s=threshold_s(row.state) - 10) for row in EXPECTED_ROWS]

    assert sweep_zombies() == sorted(run.pk for run in stuck)

    for run, row in zip(stuck, EXPECTED_ROWS):
        assert_recovered(run, row)
    assert [Run.objects.get(pk=run.pk).state for run in fresh] == [row.state for row in EXPECTED_ROWS]
    assert find_violations() == []
    # Final runs are never swept again.
    assert sweep_zombies() == []
    assert AuditLog.objects.filter(event="zombie_detected").count() == len(EXPECTED_ROWS)


def test_a_sweep_over_its_inline_maximum_hands_each_run_to_the_workers(make_run, settings,
                                                                        django_capture_on_commit_callbacks):
    settings.CELERY_TASK_ALWAYS_EAGER = True  # the handed-over tasks run here, at commit
    stuck = [place(make_run, row, age_s=threshold_s(row.state) + 5) for row in EXPECTED_ROWS]
    fresh = place(make_run, EXPECTED_ROWS[0], age_s=threshold_s(EXPECTED_ROWS[0].state) - 10)

    with django_capture_on_commit_callbacks(execute=False) as sent:
        handed = sweep_zombies(inline_max=2)
    assert handed == sorted(run.pk for run in stuck)
    assert len(sent) == len(stuck)  # one task a run, sent at commit...
    assert [Run.objects.get(pk=run.pk).state for run in stuck] == [
        row.state for row in EXPECTED_ROWS]  # ...not closed yet
    for callback in sent:
        callback()
    for run, row in zip(stuck, EXPECTED_ROWS):
        assert_recovered(run, row)
    assert Run.objects.get(pk=fresh.pk).state == EXPECTED_ROWS[0].state
    assert AuditLog.objects.filter(event="zombie_detected").count() == len(EXPECTED_ROWS)


def test_a_handed_over_run_that_moved_meanwhile_is_left_alone(make_run):
    from runs.sweeper import sweep_one

    row = EXPECTED_ROWS[0]
    fresh = place(make_run, row, age_s=threshold_s(row.state) - 10)
    assert sweep_one(fresh.pk) is False
    assert Run.objects.get(pk=fresh.pk).state == row.state
    assert not AuditLog.objects.filter(event="zombie_detected").exists()


@transactional
def test_executing_is_bounded_by_total_run_time(make_run):
    """A run that keeps changing state inside EXECUTING is still swept once
    its total execution time is over the run timeout."""
    now = timezone.now()
    run = make_run("EXECUTING", previous_state="AWAITING_HITL", timeout_s=RUN_TIMEOUT_S,
                   executing_started_at=now - timedelta(seconds=RUN_TIMEOUT_S + 5),
                   last_state_change_at=now - timedelta(seconds=1))
    Job.objects.filter(pk=run.job_id).update(status="running")

    assert sweep_zombies() == [run.pk]
    assert Run.objects.get(pk=run.pk).state == "CLOSED_FAILED"
    assert Run.objects.get(pk=run.pk).closing_cause == "run_timeout"


@transactional
def test_sweeper_gives_up_when_another_writer_moved_the_run(make_run):
    row = Row("EXECUTING", ("TIMEOUT", "TRACING", "CLOSED_FAILED"), previous_state="POLICY_CHECK")
    run = place(make_run, row, age_s=RUN_TIMEOUT_S + 5)
    seen_by_sweeper = Run.objects.get(pk=run.pk)
    run_transition(run, "CANCELLED", caller="user", expected="EXECUTING")

    assert sweep_run(seen_by_sweeper, age=timedelta(seconds=RUN_TIMEOUT_S + 5)) is False

    assert Run.objects.get(pk=run.pk).state == "CANCELLED"
    events = list(AuditLog.objects.filter(run_id=run.pk).order_by("id").values_list("event", "to_state"))
    assert events == [("state_changed", "CANCELLED"), ("zombie_detected", ""), ("transition_lost", "TIMEOUT")]


@pytest.mark.skipif(any(name.startswith("EXECGO_ZOMBIE_") for name in os.environ),
                    reason="thresholds overridden in the environment")
def test_default_thresholds_are_the_spec_s():
    assert django_settings.EXECGO_ZOMBIE_THRESHOLDS_S == {
        "CREATED": 30, "PREPARING": 60, "PLANNING": 180, "POLICY_CHECK": 30, "TRACING": 60, "TRANSIENT": 30,
        "EXECUTING_IDLE": 30,
    }
    assert django_settings.EXECGO_SWEEP_RESENDS == 3
    assert django_settings.EXECGO_RUN_TIMEOUT_S == 600


def advance_rows(run: Run) -> int:
    return sum(row.args == [run.pk] for row in Dispatch.objects.filter(task="runs.tasks.advance_run"))


@pytest.mark.django_db  # one transaction: its commit callbacks are captured, never run
def test_a_stuck_run_is_sent_its_work_again_then_failed_once_its_resends_are_spent(
        make_run, settings, django_capture_on_commit_callbacks):
    """A run whose message was lost is driven again, never failed for it,
    until its re-sends are spent; its failure then says so."""
    settings.EXECGO_SWEEP_RESENDS = 2
    row = EXPECTED_ROWS[0]
    run = place(make_run, row, age_s=threshold_s(row.state) + 5, resends=0)
    for sent in (1, 2):
        with django_capture_on_commit_callbacks(execute=False):  # the broker never takes it
            assert sweep_zombies() == []
        fresh = Run.objects.get(pk=run.pk)
        assert (fresh.state, fresh.resends) == (row.state, sent)
        assert advance_rows(run) == sent  # committed with the re-send, for the relay
        assert sweep_zombies() == []  # a re-send gets a threshold of its own
        assert Run.objects.get(pk=run.pk).resends == sent
        Run.objects.filter(pk=run.pk).update(resent_at=timezone.now() - timedelta(seconds=threshold_s(row.state) + 5))

    assert sweep_zombies() == [run.pk]
    assert Run.objects.get(pk=run.pk).state == "CLOSED_FAILED"
    resent = AuditLog.objects.filter(run_id=run.pk, event="work_resent").order_by("id")
    assert [(entry.data["resends"], entry.from_state, entry.forced_by) for entry in resent] == [
        (1, row.state, ZOMBIE_SWEEPER), (2, row.state, ZOMBIE_SWEEPER)]
    key_trace = Trace.objects.get(run=run, kind="run", from_state=row.state, to_state="FAILED")
    assert "sent again 2 times" in key_trace.error["message"]
    assert (key_trace.error["details"]["bound"], key_trace.error["details"]["resends"]) == ("resends", 2)
    assert find_violations() == []


@pytest.mark.django_db
def test_an_executing_run_whose_queued_steps_went_nowhere_is_sent_them_again(
        make_run, settings, django_capture_on_commit_callbacks):
    idle = settings.EXECGO_ZOMBIE_THRESHOLDS_S["EXECUTING_IDLE"]
    row = Row("EXECUTING", ("TIMEOUT", "TRACING", "CLOSED_FAILED"), previous_state="POLICY_CHECK")
    lost = place(make_run, row, age_s=idle + 5, resends=0)
    busy = place(make_run, row, age_s=idle + 5, resends=0)
    young = place(make_run, row, age_s=idle - 10, resends=0)
    for run, status in ((lost, "accepted"), (busy, "running"), (young, "accepted")):
        Step.objects.create(run=run, step_id="a", position=0, tool="shell", params={"argv": ["true"]},
                            timeout_s=10, run_status=status, attempt=1)

    with django_capture_on_commit_callbacks(execute=False) as sent:
        assert sweep_zombies() == []
    assert len(sent) == 2  # the queued attempt again, and the run's own driver
    assert [Run.objects.get(pk=run.pk).resends for run in (lost, busy, young)] == [1, 0, 0]
    assert advance_rows(lost) == 1
    [resent] = AuditLog.objects.filter(event="work_resent")
    assert (resent.run_id, resent.from_state, resent.data["steps"]) == (lost.pk, "EXECUTING", ["a"])
    assert set(Run.objects.values_list("state", flat=True)) == {"EXECUTING"}
