"""A shell step reports progress with lines `::progress <0-100> <message>`
on stdout; each becomes a task_progressed event (docs/data-plane.md#events)."""

import pytest

from runs.execution import execute_claims
from runs.models import Event, Run
from runs.pipeline import run_advance
from runs.services import run_submit

pytestmark = pytest.mark.django_db(transaction=True)


def test_progress_lines_become_events(tenant, agent):
    script = "echo '::progress 25 fetching'; sleep 0.3; echo '::progress 80 parsing'; sleep 0.3; echo done"
    plan = {"steps": [{"id": "work", "tool": "shell", "params": {"script": script}}]}
    run_id = run_submit(tenant=tenant, user=agent, plan=plan).run.pk
    execute_claims(run_advance(run_id))
    run = Run.objects.get(pk=run_id)
    assert run.state == "SUCCEEDED"

    progressed = Event.objects.filter(run=run, type="task_progressed").order_by("id")
    assert [(e.data["progress"], e.message) for e in progressed] == [(25, "fetching"), (80, "parsing")]
    step = run.steps.get()
    assert {e.handle_id for e in progressed} == {step.handle_id}
    assert step.progress == 100
    types = list(Event.objects.filter(run=run, task_id="work").values_list("type", flat=True))
    assert types == ["task_submitted", "task_accepted", "task_started", "task_progressed", "task_progressed",
                     "task_succeeded"]
    assert "done" in step.result["output"]["stdout"]
