"""A sequential chain starts each next step in a spare shim, forked while
the previous step's result was being recorded; a spare that no step takes
never outlives the chain."""

import json

import psutil
import pytest
from django.utils import timezone

from runs.execution import execute_claims, step_finish
from runs.models import Run, Step, StepStatus
from runs.pipeline import run_advance
from runs.services import run_submit
from runtime import executor, forkserver, layout
from tests.conftest import simple_plan, wait_until
from tests.runs.conftest import start_attempt

pytestmark = pytest.mark.django_db(transaction=True)


def shims_of_the_fork_server() -> list[psutil.Process]:
    pid = forkserver.server_pid(str(layout.tasks_dir()))
    if pid is None:
        return []
    return [child for child in psutil.Process(pid).children() if child.status() != psutil.STATUS_ZOMBIE]


def test_each_next_step_of_a_chain_starts_in_a_spare(tenant, agent):
    run = run_submit(tenant=tenant, user=agent, plan=simple_plan(*[["true"]] * 5)).run

    execute_claims(run_advance(run.pk))

    assert Run.objects.get(pk=run.pk).state == "SUCCEEDED"
    started = [json.loads((layout.task_dir(handle) / "launch.json").read_text())["via"]
               for handle in Step.objects.filter(run=run).order_by("position").values_list("handle_id", flat=True)]
    assert started[1:] == ["spare"] * 4  # the first step's shim was forked on demand
    wait_until(lambda: shims_of_the_fork_server() == [], what="every shim and spare gone")


def test_a_spare_is_closed_when_the_chain_stops_at_a_cancel(tenant, agent, make_run):
    forkserver.start_server(layout.shim_python(), str(layout.tasks_dir()), 600)
    run = make_run("EXECUTING")
    first, second = Step.objects.bulk_create([
        Step(run=run, step_id="a", position=0, tool="shell", params={"argv": ["true"]}, timeout_s=5),
        Step(run=run, step_id="b", position=1, tool="shell", params={"argv": ["true"]}, timeout_s=5,
             depends_on=["a"]),
    ])
    first = start_attempt(first)
    Run.objects.filter(pk=run.pk).update(cancel_requested_at=timezone.now(), cancel_requested_by=agent)
    first.run.cancel_requested_at = timezone.now()
    result = executor.execute(first.handle_id, tool="shell", params={"argv": ["true"]}, timeout_s=5, attempt=1,
                              plan=first.effective_plan)

    claim = step_finish(first, 1, result, steps=[first, second])

    assert claim is None
    assert Run.objects.get(pk=run.pk).state == "CLOSED_CANCELLED"
    assert Step.objects.get(pk=second.pk).status == StepStatus.SKIPPED
    wait_until(lambda: shims_of_the_fork_server() == [], what="the unused spare gone")
