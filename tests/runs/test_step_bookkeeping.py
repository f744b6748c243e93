"""What a step costs the database on a sequential plan: a fixed number of
statements in one transaction between two steps, whatever the plan's
length, and the run's steps read once per chain, not once per step."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from runs.execution import execute_claims
from runs.models import Event, EventType, Run, Step, StepStatus
from runs.pipeline import run_advance
from runs.services import run_submit
from runtime.models import HostCapacity, Reservation
from tests.conftest import simple_plan

pytestmark = pytest.mark.django_db(transaction=True)

# Between two steps: lock the run, write the result, start the next step,
# hand the ledger slot over, write the events (one INSERT).
STATEMENTS_PER_STEP = 5


TRANSACTION_CONTROL = ("BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE SAVEPOINT")


def run_chain(tenant, agent, length: int) -> tuple[Run, list[str]]:
    """Run a chain of ``length`` ``true`` steps in this process; return the
    run and the data statements it took (transaction control left out)."""
    run = run_submit(tenant=tenant, user=agent, plan=simple_plan(*[["true"]] * length)).run
    with CaptureQueriesContext(connection) as captured:
        execute_claims(run_advance(run.pk))
    statements = [query["sql"] for query in captured.captured_queries]
    return Run.objects.get(pk=run.pk), [sql for sql in statements if not sql.startswith(TRANSACTION_CONTROL)
                                        and not is_cancel_poll(sql)]


def is_cancel_poll(sql: str) -> bool:
    """The executor asks whether the run was cancelled every CANCEL_POLL_S
    while a step runs: by the clock, not once per step (a slow machine asks
    more often), so it is left out of the per-step count."""
    return sql.startswith("SELECT 1 AS") and '"cancel_requested_at" IS NULL' in sql


def step_reads(statements: list[str]) -> int:
    return sum(1 for sql in statements if sql.startswith("SELECT") and 'FROM "runs_step"' in sql)


def test_a_longer_chain_costs_a_fixed_number_of_statements_per_step(tenant, agent):
    run_chain(tenant, agent, 1)  # registers this host in the ledger
    short, short_sql = run_chain(tenant, agent, 3)
    long, long_sql = run_chain(tenant, agent, 13)

    assert (short.state, long.state) == ("SUCCEEDED", "SUCCEEDED")
    assert len(long_sql) - len(short_sql) == 10 * STATEMENTS_PER_STEP
    # Settle reads the steps when the chain starts; its later decisions
    # come from what it read (plus the summary and memory reads at the end).
    assert step_reads(long_sql) == step_reads(short_sql)


def test_the_chain_leaves_every_step_event_and_slot_accounted_for(tenant, agent):
    run, _ = run_chain(tenant, agent, 6)

    assert run.state == "SUCCEEDED"
    steps = list(Step.objects.filter(run=run).order_by("position"))
    assert [step.status for step in steps] == [StepStatus.SUCCESS] * 6
    assert all(step.attempt == 1 and step.handle_id and step.effective_plan for step in steps)
    for step in steps:
        types = list(Event.objects.filter(run=run, task_id=step.step_id).order_by("pk").values_list("type", flat=True))
        assert types == [EventType.TASK_SUBMITTED, EventType.TASK_ACCEPTED, EventType.TASK_STARTED,
                         EventType.TASK_SUCCEEDED]
    # Each step started after the one it depends on finished.
    for before, after in zip(steps, steps[1:]):
        assert before.finished_at <= after.started_at
    assert not Reservation.objects.exists()
    assert HostCapacity.objects.get().task_slots_reserved == 0
