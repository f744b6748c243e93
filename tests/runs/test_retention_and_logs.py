"""Step logs over the API while they exist; the retention GC purges
workspaces and logs of old final runs, keeps the rows, and audits it."""

from datetime import timedelta

import pytest
from django.utils import timezone

from runs.execution import execute_claims
from runs.models import AuditLog, Run
from runs.pipeline import run_advance
from runs.retention import purge_expired_artifacts, run_handles
from runs.services import run_submit
from runtime.layout import task_dir
from tests.conftest import make_user, token_client

pytestmark = pytest.mark.django_db(transaction=True)


def finished_run(tenant, agent, *scripts: str) -> Run:
    plan = {"steps": [{"id": "s" if index == 0 else f"s{index}", "tool": "shell", "params": {"script": script},
                       "depends_on": [] if index == 0 else ["s"]} for index, script in enumerate(scripts)]}
    run_id = run_submit(tenant=tenant, user=agent, plan=plan).run.pk
    execute_claims(run_advance(run_id))
    return Run.objects.get(pk=run_id)


def test_full_logs_are_served_beyond_the_stored_tail(tenant, agent, api, settings):
    settings.EXECGO_OUTPUT_TAIL_BYTES = 100
    run = finished_run(tenant, agent, "seq 1 5000; echo oops >&2")
    assert run.state == "SUCCEEDED"
    step = run.steps.get()
    assert len(step.result["output"]["stdout"]) <= 100
    response = api.get(f"/api/v1/runs/{run.pk}/steps/s/logs/stdout")
    assert response.status_code == 200
    body = b"".join(response.streaming_content)
    assert body == "".join(f"{n}\n" for n in range(1, 5001)).encode()
    stderr = api.get(f"/api/v1/runs/{run.pk}/steps/s/logs/stderr")
    assert b"".join(stderr.streaming_content) == b"oops\n"
    assert api.get(f"/api/v1/runs/{run.pk}/steps/s/logs/journal").status_code == 404
    assert api.get(f"/api/v1/runs/{run.pk}/steps/nope/logs/stdout").status_code == 404


def test_logs_of_another_tenant_are_not_served(tenant, other_tenant, agent):
    run = finished_run(tenant, agent, "echo secret")
    outsider = token_client(make_user("outsider", other_tenant))
    response = outsider.get(f"/api/v1/runs/{run.pk}/steps/s/logs/stdout")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def test_gc_purges_old_final_runs_and_keeps_rows(tenant, agent, api, settings):
    settings.EXECGO_TASK_RETENTION_S = 3600
    old = finished_run(tenant, agent, "echo one", "echo two; exit 1")  # two steps, two directories
    young = finished_run(tenant, agent, "echo fresh")
    handles = run_handles(old)
    assert len(handles) == 2 and all(task_dir(h).is_dir() for h in handles)
    Run.objects.filter(pk=old.pk).update(finished_at=timezone.now() - timedelta(hours=2))

    assert purge_expired_artifacts() == [old.pk]
    for handle in handles:
        assert not (task_dir(handle) / "workspace").exists()
        assert not (task_dir(handle) / "stdout.log").exists()
    assert all(task_dir(h).is_dir() for h in run_handles(young))
    old.refresh_from_db()
    assert old.artifacts_purged_at is not None
    assert old.state == "CLOSED_FAILED"
    assert old.steps.get(step_id="s1").result["status"] == "failed"  # the rows stay
    assert old.traces.exists()
    purge = AuditLog.objects.get(run=old, event="artifacts_purged")
    assert len(purge.data["removed"]) >= 2
    assert api.get(f"/api/v1/runs/{old.pk}/steps/s/logs/stdout").status_code == 404
    assert purge_expired_artifacts() == []  # recorded once
    assert AuditLog.objects.filter(event="artifacts_purged").count() == 1


def test_gc_leaves_live_runs_alone(tenant, agent, make_run, settings):
    settings.EXECGO_TASK_RETENTION_S = 0
    live = make_run("EXECUTING")
    assert purge_expired_artifacts(now=timezone.now() + timedelta(days=30)) == []
    live.refresh_from_db()
    assert live.artifacts_purged_at is None
