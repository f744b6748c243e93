"""The history checker finds each kind of broken history, and passes a
sound one (the fault tests rely on both)."""

from datetime import timedelta

import pytest
from django.utils import timezone

from runs.execution import execute_claims
from runs.models import Event, EventType, Run, Step, StepRunStatus
from runs.pipeline import run_advance
from runs.services import run_submit
from tests.conftest import simple_plan
from tests.reliability.checker import check_history

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def sound(tenant, agent):
    """Two runs of two steps each, driven here to SUCCEEDED."""
    run_ids = []
    for _ in range(2):
        run_id = run_submit(tenant=tenant, user=agent, plan=simple_plan(["true"], ["echo", "ok"])).run.pk
        execute_claims(run_advance(run_id))
        run_ids.append(run_id)
    assert set(Run.objects.filter(pk__in=run_ids).values_list("state", flat=True)) == {"SUCCEEDED"}
    return run_ids


def event(run_id: int, kind: str, *, task_id: str = "", **data) -> None:
    Event.objects.create(run_id=run_id, type=kind, task_id=task_id, timestamp=timezone.now(), data=data)


def test_a_sound_history_passes_with_its_exports(sound, tmp_path):
    assert check_history(sound, export_dir=tmp_path) == []
    assert list(tmp_path.glob("audit-*.jsonl"))


def test_a_run_left_unfinished_is_found(sound, make_run):
    stuck = make_run("EXECUTING")  # (made without its job's projection: reconcile says so too)
    assert check_history([*sound, stuck.pk])[0] == f"run {stuck.pk} is EXECUTING, not final"


def test_an_accepted_run_that_is_gone_is_found(sound):
    assert check_history([*sound, 10**9]) == [f"run {10**9} was accepted but does not exist"]


def test_a_run_that_ended_twice_is_found(sound):
    event(sound[0], EventType.RUN_STATE_CHANGED, **{"from": "TRACING", "to": "SUCCEEDED"})
    assert check_history(sound) == [f"run {sound[0]} entered a final state 2 times"]


def test_an_attempt_started_twice_and_a_step_started_after_its_success_are_found(sound):
    step = Step.objects.filter(run_id=sound[0]).order_by("position").first()
    event(sound[0], EventType.TASK_STARTED, task_id=step.step_id, attempt=1)
    event(sound[1], EventType.TASK_STARTED, task_id=step.step_id, attempt=2)
    assert check_history(sound) == [
        f"run {sound[0]} step {step.step_id} attempt 1 started 2 times",
        f"run {sound[1]} step {step.step_id} started attempt 2 after attempt 1 succeeded",
    ]


def test_an_attempt_that_ended_twice_is_found(sound):
    step = Step.objects.filter(run_id=sound[1]).order_by("position").last()
    event(sound[1], EventType.TASK_FAILED, task_id=step.step_id, attempt=1)
    assert check_history(sound) == [f"run {sound[1]} step {step.step_id} attempt 1 ended 2 times"]


def test_a_run_that_ended_past_its_deadline_and_grace_is_found(sound):
    run = Run.objects.get(pk=sound[0])
    Run.objects.filter(pk=run.pk).update(finished_at=run.deadline + timedelta(seconds=20))
    assert check_history(sound, grace_s=15) == [f"run {run.pk} ended 20.0 s after its deadline (grace 15 s)"]


def test_a_final_run_with_a_step_still_running_is_found(sound):
    step = Step.objects.filter(run_id=sound[0]).order_by("position").first()
    Step.objects.filter(pk=step.pk).update(run_status=StepRunStatus.RUNNING)
    assert check_history(sound) == [f"run {sound[0]} is final but its step {step.step_id} is still running"]


def test_reconcile_s_invariants_are_part_of_it(sound):
    Run.objects.filter(pk=sound[1]).update(state="CLOSED_FAILED")  # no run_failed audit row for it
    found = check_history(sound)
    assert f"run {sound[1]} is CLOSED_FAILED but has final audit events {{'run_succeeded': 1}}" in found


def test_a_side_effect_that_happened_twice_or_never_is_found(sound):
    first, second = (Step.objects.filter(run_id=run_id).order_by("position").first() for run_id in sound)
    assert check_history(sound, side_effects={(sound[0], first.step_id): 1, (sound[1], second.step_id): 1}) == []
    assert check_history(sound, side_effects={(sound[0], first.step_id): 2, (sound[1], second.step_id): 0}) == [
        f"run {sound[0]} step {first.step_id}: its side effect happened 2 times in 1 started attempts",
        f"run {sound[1]} step {second.step_id} succeeded but its side effect never happened",
    ]
