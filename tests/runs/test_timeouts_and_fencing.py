"""Two timeout layers, fencing of late results, and a failed trace write."""

from datetime import timedelta

import pytest
from django.db import DatabaseError

from runs import closing
from runs.execution import execute_claims
from runs.models import AuditLog, Run
from runs.pipeline import run_advance
from runs.services import run_submit
from runs.sweeper import sweep_run
from tests.conftest import simple_plan, wait_for_run, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def test_harness_fires_the_run_timeout(api, celery_worker):
    plan = {"steps": [{"id": "slow", "tool": "shell", "params": {"argv": ["sleep", "30"]}, "timeout_s": 300}]}
    run_id = api.post("/api/v1/runs", {"plan": plan, "timeout_s": 2}, format="json").json()["id"]
    run = wait_for_run(run_id, timeout=30)
    assert (run.state, run.closing_cause) == ("CLOSED_FAILED", "run_timeout")
    fired = AuditLog.objects.get(run=run, from_state="EXECUTING", to_state="TIMEOUT")
    assert fired.data == {"layer": "harness"}
    assert not AuditLog.objects.filter(run=run, event__startswith="zombie").exists()
    trace = run.traces.get(kind="run", to_state="TIMEOUT")
    assert trace.data["layer"] == "harness" and trace.error["code"] == "timeout"
    step = run.steps.get()
    assert step.result["error"]["code"] == "timeout"
    assert AuditLog.objects.filter(run=run, event="run_failed").count() == 1


def test_late_result_after_the_sweeper_closed_the_run_is_audited_not_applied(api, celery_worker):
    plan = {"steps": [{"id": "slow", "tool": "shell", "params": {"argv": ["sleep", "20"]}}]}
    run_id = api.post("/api/v1/runs", {"plan": plan}, format="json").json()["id"]
    wait_for_run(run_id, states={"EXECUTING"})
    wait_until(lambda: Run.objects.get(pk=run_id).steps.filter(run_status="running").exists(),
               what="step running")
    assert sweep_run(Run.objects.get(pk=run_id), age=timedelta(hours=1)) is True
    run = Run.objects.get(pk=run_id)
    assert (run.state, run.closing_cause) == ("CLOSED_FAILED", "run_timeout")
    step = run.steps.get()
    assert (step.status, step.run_status) == ("failed", "cancelled")
    superseded = "run forced from EXECUTING to TIMEOUT by the zombie sweeper"
    assert step.result["error"]["message"] == superseded

    # The worker notices the run left EXECUTING, kills the command, and its
    # result finds the fence gone.
    wait_until(lambda: AuditLog.objects.filter(run=run, event="stale_result_ignored").exists(),
               what="late result audited")
    stale = AuditLog.objects.get(run=run, event="stale_result_ignored")
    assert stale.data["step"] == "slow" and stale.data["attempt"] == 1
    step.refresh_from_db()
    assert step.result["error"]["message"] == superseded
    assert [e for e in AuditLog.objects.filter(run=run).values_list("event", flat=True)
            if e.startswith("zombie")] == ["zombie_detected", "zombie_recovered"]


def test_failed_trace_write_leaves_the_run_in_tracing_for_the_sweeper(tenant, agent, monkeypatch):
    run_id = run_submit(tenant=tenant, user=agent, plan=simple_plan(["true"])).run.pk

    def broken_memory_write(run, steps=None):
        raise DatabaseError("disk full")

    monkeypatch.setattr(closing, "memory_write", broken_memory_write)
    with pytest.raises(DatabaseError):
        execute_claims(run_advance(run_id))
    run = Run.objects.get(pk=run_id)
    assert run.state == "TRACING"
    assert not AuditLog.objects.filter(run=run, event="run_succeeded").exists()

    monkeypatch.undo()
    assert sweep_run(run, age=timedelta(minutes=5)) is True
    run.refresh_from_db()
    assert (run.state, run.closing_cause) == ("CLOSED_FAILED", "failed")
    assert list(run.traces.filter(kind="transition").values_list("to_state", flat=True))[-3:] == [
        "FAILED", "TRACING", "CLOSED_FAILED"]
    assert AuditLog.objects.get(run=run, to_state="FAILED").forced_by == "zombie_sweeper"
