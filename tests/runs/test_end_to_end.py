"""Submit over HTTP, execute on a real Celery worker process, read back."""

import time

import pytest

from runs.dataplane import can_sandbox
from runs.models import AuditLog, Job, Run
from tests.conftest import wait_for_run

pytestmark = pytest.mark.django_db(transaction=True)

THREE_STEPS = {
    "steps": [
        {"id": "fetch", "tool": "shell", "params": {"argv": ["echo", "fetched"]}},
        {"id": "count", "tool": "shell", "params": {"script": "echo $((20 + 22))"}, "depends_on": ["fetch"]},
        {"id": "report", "tool": "shell", "params": {"argv": ["printf", "done"]}, "depends_on": ["count"]},
    ]
}


def test_three_step_plan_reaches_succeeded(api, celery_worker):
    response = api.post("/api/v1/runs", {"title": "three", "plan": THREE_STEPS}, format="json")
    assert response.status_code == 201, response.content
    run = wait_for_run(response.json()["id"])

    assert run.state == "SUCCEEDED"
    assert run.closing_cause == "succeeded"
    body = api.get(f"/api/v1/runs/{run.pk}").json()
    assert [(s["id"], s["status"], s["run_status"]) for s in body["steps"]] == [
        ("fetch", "success", "success"), ("count", "success", "success"), ("report", "success", "success"),
    ]
    count = body["steps"][1]["result"]
    assert count["status"] == "success"
    assert count["output"] == {"exit_code": 0, "stdout": "42\n"}
    assert count["error"] is None
    assert set(count) >= {"handle_id", "started_at", "finished_at", "duration_ms", "attempt", "details"}
    step = body["steps"][1]
    assert step["requested_plan"] == {}
    assert step["effective_plan"]["profile"] == ("linux_sandbox" if can_sandbox() else "process")
    assert step["effective_plan"]["network"] == "none"
    assert step["host"] and step["progress"] == 100

    job = api.get(f"/api/v1/jobs/{run.job_id}").json()
    assert job["status"] == "done"
    assert job["latest_run"] == run.pk
    assert job["run_state_snapshot"]["state"] == "SUCCEEDED"

    events = api.get(f"/api/v1/runs/{run.pk}/events").json()["events"]
    transitions = [(e["data"]["from"], e["data"]["to"]) for e in events if e["type"] == "run_state_changed"]
    assert transitions == [
        (None, "CREATED"), ("CREATED", "PREPARING"), ("PREPARING", "PLANNING"), ("PLANNING", "POLICY_CHECK"),
        ("POLICY_CHECK", "EXECUTING"), ("EXECUTING", "TRACING"), ("TRACING", "SUCCEEDED"),
    ]
    assert [e["id"] for e in events] == sorted(e["id"] for e in events)
    assert AuditLog.objects.filter(run=run, event="run_succeeded").count() == 1


def test_failing_step_ends_closed_failed_with_error_envelope(api, celery_worker):
    plan = {"steps": [
        {"id": "ok", "tool": "shell", "params": {"argv": ["true"]}},
        {"id": "boom", "tool": "shell", "params": {"script": "echo oops >&2; exit 3"}, "depends_on": ["ok"]},
        {"id": "never", "tool": "shell", "params": {"argv": ["true"]}, "depends_on": ["boom"]},
    ]}
    response = api.post("/api/v1/runs", {"plan": plan}, format="json")
    run = wait_for_run(response.json()["id"])

    assert run.state == "CLOSED_FAILED"
    assert run.closing_cause == "failed"
    steps = {s["id"]: s for s in api.get(f"/api/v1/runs/{run.pk}").json()["steps"]}
    assert steps["ok"]["status"] == "success"
    assert steps["never"]["status"] == "skipped"
    boom = steps["boom"]
    assert (boom["status"], boom["run_status"]) == ("failed", "failed")
    assert boom["result"]["error"] == {
        "code": "external_failure", "message": "the command exited with code 3", "retryable": True,
        "source": "executor", "details": {"termination": "exited", "evidence": "exit code 3", "exit_code": 3},
    }
    assert "oops" in boom["result"]["details"]["stderr"]
    assert Job.objects.get(pk=run.job_id).status == "failed"
    events = api.get(f"/api/v1/runs/{run.pk}/events").json()["events"]
    states = [e["data"]["to"] for e in events if e["type"] == "run_state_changed"]
    assert states[-3:] == ["FAILED", "TRACING", "CLOSED_FAILED"]
    assert AuditLog.objects.filter(run=run, event="run_failed").count() == 1


def test_events_resume_after_cursor(api, celery_worker):
    run_id = api.post("/api/v1/runs", {"plan": THREE_STEPS}, format="json").json()["id"]
    wait_for_run(run_id)
    everything = api.get(f"/api/v1/runs/{run_id}/events").json()
    cursor = everything["events"][3]["id"]
    rest = api.get(f"/api/v1/runs/{run_id}/events?after={cursor}").json()
    assert [e["id"] for e in rest["events"]] == [e["id"] for e in everything["events"][4:]]
    assert rest["last_event_id"] == everything["last_event_id"]
    assert Run.objects.get(pk=run_id).state == "SUCCEEDED"


def test_cancel_of_an_executing_run_kills_the_step(api, celery_worker):
    import psutil

    marker = "execgo-cancel-marker-7d1f"
    plan = {"steps": [{"id": "long", "tool": "shell", "params": {"script": f"sleep 600 # {marker}"},
                       "timeout_s": 900}]}
    run_id = api.post("/api/v1/runs", {"plan": plan}, format="json").json()["id"]
    wait_for_run(run_id, states={"EXECUTING"})
    for _ in range(600):
        if any(marker in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])):
            break
        time.sleep(0.05)
    else:
        pytest.fail("the step's process never started")
    assert api.post(f"/api/v1/runs/{run_id}/cancel").status_code == 202
    run = wait_for_run(run_id, timeout=30)

    assert (run.state, run.closing_cause) == ("CLOSED_CANCELLED", "cancelled")
    step = run.steps.get()
    assert (step.status, step.run_status) == ("failed", "cancelled")
    assert step.result["error"]["code"] == "cancelled"
    assert not [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    assert Job.objects.get(pk=run.job_id).status == "failed"
    assert AuditLog.objects.get(run=run, event="run_cancelled").actor.username == "agent"
