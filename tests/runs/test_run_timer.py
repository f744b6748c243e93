"""The run's own timer (runs/settle.py, ``executing_started``) is armed only
for a run that outlives the chain of claims that started it: a run whose
steps all end in that chain never needs one, and its message would only sit
in a worker's memory until the deadline. A run still EXECUTING when the
chain ends gets its timer then, due at its deadline."""

from datetime import datetime

import pytest

from runs.execution import execute_claims
from runs.models import Run, Step, StepRunStatus
from runs.pipeline import run_advance
from runs.services import run_submit
from tests.conftest import purge_broker, simple_plan
from tests.runs.test_ledger_heal import queued

pytestmark = pytest.mark.django_db(transaction=True)

SETTLE = "runs.tasks.settle_run"


def timers(run_id: int) -> list[dict]:
    return [message for message in queued("celery") if (message["task"], message["args"]) == (SETTLE, [run_id])]


def test_a_run_its_chain_ends_sends_no_timer(tenant, agent):
    purge_broker()
    run_id = run_submit(tenant=tenant, user=agent, plan=simple_plan(["true"], ["true"])).run.pk

    execute_claims(run_advance(run_id))

    assert Run.objects.get(pk=run_id).state == "SUCCEEDED"
    assert timers(run_id) == []


def test_a_run_that_outlives_its_chain_gets_its_timer_due_at_its_deadline(tenant, agent):
    """Two steps with no order between them: the chain runs one, the other
    waits in the queue for a worker, so the run is still EXECUTING."""
    purge_broker()
    plan = {"steps": [{"id": "a", "tool": "shell", "params": {"argv": ["true"]}},
                      {"id": "b", "tool": "shell", "params": {"argv": ["true"]}}]}
    run_id = run_submit(tenant=tenant, user=agent, plan=plan, timeout_s=120).run.pk

    claim = run_advance(run_id)
    assert claim is not None and claim.timer_owed is not None
    assert timers(run_id) == []  # not before the chain has ended
    execute_claims(claim)

    run = Run.objects.get(pk=run_id)
    assert run.state == "EXECUTING"
    assert Step.objects.filter(run_id=run_id, run_status=StepRunStatus.SUCCESS).count() == 1
    [timer] = timers(run_id)
    eta, expires = datetime.fromisoformat(timer["eta"]), datetime.fromisoformat(timer["expires"])
    assert abs((eta - run.deadline).total_seconds()) < 5
    assert eta < expires


def test_a_chain_that_fails_still_arms_the_timer_of_a_run_left_executing(tenant, agent, monkeypatch):
    import runs.execution

    purge_broker()
    run_id = run_submit(tenant=tenant, user=agent, plan=simple_plan(["true"]), timeout_s=120).run.pk
    claim = run_advance(run_id)

    def broken(*args, **kwargs):
        raise RuntimeError("the worker's disk is full")

    monkeypatch.setattr(runs.execution, "step_execute", broken)
    with pytest.raises(RuntimeError):
        execute_claims(claim)

    assert Run.objects.get(pk=run_id).state == "EXECUTING"
    assert len(timers(run_id)) == 1
