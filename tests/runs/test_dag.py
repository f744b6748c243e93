"""EXECUTING as a DAG on real worker processes: parallel branches, skips,
retries with attempts and events (docs/stages.md#executing)."""


import pytest

from runs.models import AuditLog, Event, Run
from tests.conftest import wait_for_run

pytestmark = pytest.mark.django_db(transaction=True)


def shell(step_id: str, script: str, *depends_on: str, **extra) -> dict:
    return {"id": step_id, "tool": "shell", "params": {"script": script}, "depends_on": list(depends_on), **extra}


def steps_of(run: Run) -> dict:
    return {step.step_id: step for step in run.steps.all()}


def test_diamond_runs_branches_concurrently(api, celery_worker):
    plan = {"steps": [
        shell("a", "echo a"),
        shell("b", "sleep 1; echo b", "a"),
        shell("c", "sleep 1; echo c", "a"),
        shell("d", "echo d", "b", "c"),
    ]}
    run = wait_for_run(api.post("/api/v1/runs", {"plan": plan}, format="json").json()["id"])
    assert run.state == "SUCCEEDED"
    steps = steps_of(run)
    b, c, d = steps["b"], steps["c"], steps["d"]
    assert b.started_at < c.finished_at and c.started_at < b.finished_at, "b and c did not overlap"
    assert d.started_at >= max(b.finished_at, c.finished_at)
    assert steps["a"].finished_at <= min(b.started_at, c.started_at)


def test_failing_branch_skips_its_dependant_and_lets_the_other_finish(api, celery_worker):
    plan = {"steps": [
        shell("a", "true"),
        shell("b", "sleep 0.3; exit 1", "a"),
        shell("c", "sleep 1.5; echo c-done", "a"),
        shell("d", "echo d", "b", "c"),
    ]}
    run = wait_for_run(api.post("/api/v1/runs", {"plan": plan}, format="json").json()["id"])
    assert (run.state, run.closing_cause) == ("CLOSED_FAILED", "failed")
    steps = steps_of(run)
    assert {k: s.status for k, s in steps.items()} == {"a": "success", "b": "failed", "c": "success",
                                                       "d": "skipped"}
    assert steps["c"].result["output"]["stdout"] == "c-done\n"
    assert steps["d"].run_status == "" and steps["d"].attempt == 0
    failure = run.traces.get(kind="tool_invocation", to_state="FAILED")
    assert failure.step_id == steps["b"].pk
    assert failure.error["code"] == "external_failure"
    transitions = list(run.traces.filter(kind="transition").values_list("to_state", flat=True))
    assert transitions[-3:] == ["FAILED", "TRACING", "CLOSED_FAILED"]
    # FAILED waited for c: the run left EXECUTING after c finished.
    left_executing = run.traces.get(kind="transition", from_state="EXECUTING").created_at
    assert left_executing >= steps["c"].finished_at


def test_step_that_fails_twice_then_succeeds(api, celery_worker):
    # A contained step keeps nothing between attempts; its handle (h-<step>-<attempt>-…) says which one it is.
    script = 'n=$(echo "$EXECGO_HANDLE_ID" | cut -d- -f3); [ "$n" -ge 3 ]'
    plan = {"steps": [shell("flaky", script, retries=3)]}
    run = wait_for_run(api.post("/api/v1/runs", {"plan": plan}, format="json").json()["id"])
    assert run.state == "SUCCEEDED"
    step = run.steps.get()
    assert (step.status, step.run_status, step.attempt) == ("success", "success", 3)
    assert step.result["attempt"] == 3
    assert step.handle_id.startswith(f"h-{step.pk}-3-")
    events = list(Event.objects.filter(run=run, task_id="flaky").values_list("type", flat=True))
    assert events.count("task_retried") == 2
    assert events.count("task_failed") == 2
    assert events[-1] == "task_succeeded"
    assert events[0] == "task_submitted"
    retried = Event.objects.filter(run=run, type="task_retried").order_by("id")
    assert [e.data["attempt"] for e in retried] == [2, 3]


def test_retries_exhausted_fail_the_run_with_retry_count(api, celery_worker):
    plan = {"steps": [shell("never", "exit 7", retries=2)]}
    run = wait_for_run(api.post("/api/v1/runs", {"plan": plan}, format="json").json()["id"])
    assert run.state == "CLOSED_FAILED"
    step = run.steps.get()
    assert (step.status, step.attempt) == ("failed", 3)
    trace = run.traces.get(kind="tool_invocation", to_state="FAILED")
    assert trace.data["retry_count"] == 2
    assert trace.error["details"]["exit_code"] == 7


def test_non_retryable_error_is_not_retried(api, celery_worker):
    plan = {"steps": [{"id": "missing", "tool": "shell", "params": {"argv": ["/no/such/binary"]}, "retries": 3}]}
    run = wait_for_run(api.post("/api/v1/runs", {"plan": plan}, format="json").json()["id"])
    assert run.state == "CLOSED_FAILED"
    step = run.steps.get()
    assert step.attempt == 1
    assert step.result["error"]["retryable"] is False
    assert not Event.objects.filter(run=run, type="task_retried").exists()


def test_step_events_carry_the_spec_fields(api, celery_worker):
    plan = {"steps": [shell("one", "echo hi")]}
    run = wait_for_run(api.post("/api/v1/runs", {"plan": plan}, format="json").json()["id"])
    events = api.get(f"/api/v1/runs/{run.pk}/events").json()["events"]
    step_events = [e for e in events if e["task_id"] == "one"]
    assert [e["type"] for e in step_events] == ["task_submitted", "task_accepted", "task_started", "task_succeeded"]
    for event in step_events:
        assert set(event) == {"id", "type", "run_id", "task_id", "handle_id", "timestamp", "message", "data"}
    assert {e["handle_id"] for e in step_events[1:]} == {run.steps.get().handle_id}
    assert not AuditLog.objects.filter(run=run, event="stale_result_ignored").exists()
