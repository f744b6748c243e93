"""Every call site that moves a step, driven through the code that calls it
(in this process, on real rows and real shims): each makes only the moves
docs/state-machine.md#steps says it makes, and together they make every
move of ``runs.step_lifecycle.MOVES``; none is declared that the code never
makes."""

import sys

import pytest
from django.utils import timezone

from runs import step_lifecycle
from runs.closing import fence_unfinished_steps
from runs.dataplane import release_reservation
from runs.errors import ErrorCode, error_envelope
from runs.execution import execute_claims, step_execute, step_finish
from runs.models import Run, Step
from runs.pipeline import run_advance
from runs.services import run_submit
from runs.settle import run_settle
from runs.step_lifecycle import MOVES
from runtime.envelopes import step_result
from tests.conftest import purge_broker
from tests.runs.conftest import start_attempt

pytestmark = pytest.mark.django_db(transaction=True)

QUEUE = (("pending", ""), ("pending", "accepted"))
START_HERE = (("pending", ""), ("running", "running"))
SKIP = (("pending", ""), ("skipped", ""))
CLAIM_FIRST = (("pending", "accepted"), ("running", "running"))
CLAIM_RETRY = (("running", "accepted"), ("running", "running"))
CANCEL_FIRST = (("pending", "accepted"), ("failed", "cancelled"))
CANCEL_RETRY = (("running", "accepted"), ("failed", "cancelled"))
SUCCEEDED = (("running", "running"), ("success", "success"))
FAILED = (("running", "running"), ("failed", "failed"))
CANCELLED = (("running", "running"), ("failed", "cancelled"))
FAILED_TO_RETRY = (("running", "running"), ("running", "failed"))
RETRY = (("running", "failed"), ("running", "accepted"))

# Each call site of ``step_set`` and the moves it may make.
CALL_SITES = {
    "runs.settle._dispatch": {QUEUE, START_HERE},
    "runs.steps.skip_pending": {SKIP},
    "runs.settle._cancel_queued": {CANCEL_FIRST, CANCEL_RETRY},
    "runs.execution._claim": {CLAIM_FIRST, CLAIM_RETRY},
    "runs.execution._step_finish": {SUCCEEDED, FAILED, CANCELLED, FAILED_TO_RETRY, RETRY},
    "runs.closing.fence_unfinished_steps": {CANCEL_FIRST, CANCEL_RETRY, CANCELLED},
}


@pytest.fixture
def made(monkeypatch):
    """The moves ``step_set`` is asked for, by the call site asking."""
    calls: list[tuple[str, tuple]] = []
    declared = step_lifecycle.move_for

    def recording(source, target):
        move = declared(source, target)
        caller = sys._getframe(2)  # move_for ← step_set ← the call site
        calls.append((f"{caller.f_globals['__name__']}.{caller.f_code.co_name}", (tuple(source), tuple(target))))
        return move

    monkeypatch.setattr(step_lifecycle, "move_for", recording)
    purge_broker()
    yield calls
    purge_broker()
    assert [(site, move) for site, move in calls if move not in CALL_SITES.get(site, ())] == []


def pair(step_pk: int) -> tuple[str, str]:
    return tuple(Step.objects.filter(pk=step_pk).values_list("status", "run_status").get())


def submit(tenant, agent, *steps: dict) -> Run:
    return run_submit(tenant=tenant, user=agent, plan={"steps": list(steps)}).run


def shell(step_id: str, argv: list[str], **fields) -> dict:
    return {"id": step_id, "tool": "shell", "params": {"argv": argv}, **fields}


def steps_of(run: Run) -> dict[str, Step]:
    return {step.step_id: step for step in Step.objects.filter(run=run)}


def test_a_chain_starts_each_step_where_it_settles_and_records_its_success(tenant, agent, made):
    run = submit(tenant, agent, shell("a", ["true"]), shell("b", ["true"], depends_on=["a"]))

    execute_claims(run_advance(run.pk))

    assert Run.objects.get(pk=run.pk).state == "SUCCEEDED"
    assert made == [("runs.settle._dispatch", START_HERE), ("runs.execution._step_finish", SUCCEEDED)] * 2


def test_a_step_queued_beside_the_one_started_is_claimed_by_its_worker(tenant, agent, made):
    run = submit(tenant, agent, shell("a", ["true"]), shell("b", ["true"]))

    execute_claims(run_advance(run.pk))  # a runs here; b waits in the queue
    queued = steps_of(run)["b"]
    assert pair(queued.pk) == ("pending", "accepted")
    execute_claims(step_execute(queued.pk, 1))  # what b's worker does

    assert Run.objects.get(pk=run.pk).state == "SUCCEEDED"
    assert set(made) == {("runs.settle._dispatch", START_HERE), ("runs.settle._dispatch", QUEUE),
                         ("runs.execution._step_finish", SUCCEEDED), ("runs.execution._claim", CLAIM_FIRST)}


def test_a_retryable_failure_queues_the_next_attempt_whose_claim_and_failure_end_the_step(tenant, agent, made):
    run = submit(tenant, agent, {"id": "flaky", "tool": "shell", "params": {"script": "exit 2"}, "retries": 1})

    execute_claims(run_advance(run.pk))
    flaky = steps_of(run)["flaky"]
    assert (pair(flaky.pk), flaky.attempt) == (("running", "accepted"), 2)
    execute_claims(step_execute(flaky.pk, 2))

    assert Run.objects.get(pk=run.pk).state == "CLOSED_FAILED"
    assert made == [("runs.settle._dispatch", START_HERE), ("runs.execution._step_finish", FAILED_TO_RETRY),
                    ("runs.execution._step_finish", RETRY), ("runs.execution._claim", CLAIM_RETRY),
                    ("runs.execution._step_finish", FAILED)]


def test_a_cancel_skips_what_never_started_cancels_what_is_queued_and_close_fences_what_runs(tenant, agent, made):
    run = submit(tenant, agent, shell("a", ["true"]), shell("b", ["true"]), shell("c", ["true"], depends_on=["a"]))
    claim = run_advance(run.pk)  # a started here (not run), b queued, c waiting for a
    Run.objects.filter(pk=run.pk).update(cancel_requested_at=timezone.now())

    run_settle(run.pk)  # a still running: the run waits for it
    steps = steps_of(run)
    assert {name: pair(step.pk) for name, step in steps.items()} == {
        "a": ("running", "running"), "b": ("failed", "cancelled"), "c": ("skipped", "")}
    fence_unfinished_steps(Run.objects.get(pk=run.pk), reason="run closed")
    release_reservation(claim.started.handle_id)

    assert pair(steps["a"].pk) == ("failed", "cancelled")
    assert made == [("runs.settle._dispatch", START_HERE), ("runs.settle._dispatch", QUEUE),
                    ("runs.steps.skip_pending", SKIP), ("runs.settle._cancel_queued", CANCEL_FIRST),
                    ("runs.closing.fence_unfinished_steps", CANCELLED)]


def test_a_retry_waiting_out_its_backoff_is_cancelled_with_its_run(tenant, agent, made):
    run = submit(tenant, agent, {"id": "flaky", "tool": "shell", "params": {"script": "exit 2"}, "retries": 1})
    execute_claims(run_advance(run.pk))
    Run.objects.filter(pk=run.pk).update(cancel_requested_at=timezone.now())

    run_settle(run.pk)

    assert pair(steps_of(run)["flaky"].pk) == ("failed", "cancelled")
    assert Run.objects.get(pk=run.pk).state == "CLOSED_CANCELLED"
    assert made[-1] == ("runs.settle._cancel_queued", CANCEL_RETRY)


def test_close_fences_queued_attempts_first_and_retried(make_run, made):
    run = make_run("FAILED", previous_state="EXECUTING")
    first = Step.objects.create(run=run, step_id="a", position=0, tool="shell", params={}, timeout_s=5,
                                run_status="accepted", attempt=1, handle_id="h-a-1")
    retried = Step.objects.create(run=run, step_id="b", position=1, tool="shell", params={}, timeout_s=5,
                                  status="running", run_status="accepted", attempt=2, handle_id="h-b-2")

    fence_unfinished_steps(run, reason="run closed")

    assert pair(first.pk) == pair(retried.pk) == ("failed", "cancelled")
    assert set(made) == {("runs.closing.fence_unfinished_steps", CANCEL_FIRST),
                         ("runs.closing.fence_unfinished_steps", CANCEL_RETRY)}


def test_an_attempt_that_was_cancelled_ends_its_step_failed(make_run, made):
    run = make_run("EXECUTING", previous_state="POLICY_CHECK")
    step = start_attempt(Step.objects.create(run=run, step_id="a", position=0, tool="shell",
                                             params={"argv": ["true"]}, timeout_s=5))

    step_finish(step, 1, step_result(status="cancelled", handle_id=step.handle_id, output={},
                                     started_at=step.started_at, finished_at=timezone.now(), attempt=1,
                                     error=error_envelope(ErrorCode.CANCELLED, "run cancelled", source="executor")))

    assert pair(step.pk) == ("failed", "cancelled")
    assert made == [("runs.execution._step_finish", CANCELLED)]


def test_the_call_sites_make_every_declared_move_and_no_other():
    """The table holds what the scenarios above show the code does: each
    call site's moves are declared, and every declared move has a call site."""
    declared = {(move.source, move.target) for move in MOVES}
    for site, moves in CALL_SITES.items():
        assert moves <= declared, site
    assert set().union(*CALL_SITES.values()) == declared
