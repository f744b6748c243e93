"""Step logs over the API while they exist; the retention GC purges
workspaces and logs of old final runs on every host that ran them, keeps
the rows, and audits it."""

import os
import shutil
from datetime import timedelta

import pytest
from celery import current_app
from django.utils import timezone

from runs.dataplane import current_host, host_queue
from runs.execution import execute_claims
from runs.models import AuditLog, Event, Run, Step
from runs.pipeline import run_advance
from runs.retention import purge_expired_artifacts
from runs.services import run_submit
from runs.tasks import purge_expired_run_artifacts
from runs.worker_start import hosts_to_heal
from runtime import ledger
from runtime.gc import PURGED
from runtime.layout import task_dir
from runtime.models import HostCapacity
from tests.conftest import make_user, purge_broker, token_client
from tests.runs.test_ledger_heal import queued

pytestmark = pytest.mark.django_db(transaction=True)


def run_handles(run: Run) -> set[str]:
    """Every attempt's handle: the step rows keep only the latest one, the
    events name them all."""
    handles = set(Event.objects.filter(run=run).exclude(handle_id="").values_list("handle_id", flat=True))
    return handles | set(Step.objects.filter(run=run).exclude(handle_id="").values_list("handle_id", flat=True))


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


def test_each_host_purges_the_task_directories_of_the_attempts_it_ran(tenant, agent, settings, tmp_path):
    """A task directory is on the disk of the host that ran its attempt: a
    run whose steps ran on two hosts is purged on each, by each host's own
    purge, audited once per host."""
    settings.EXECGO_TASK_RETENTION_S = 3600
    old = finished_run(tenant, agent, "echo one", "echo two")
    here, there = (old.steps.get(step_id=step_id).handle_id for step_id in ("s", "s1"))
    host_b_tasks = tmp_path / "host-b-tasks"
    host_b_tasks.mkdir()
    shutil.move(task_dir(there), host_b_tasks / there)  # the second step ran on host-b
    Run.objects.filter(pk=old.pk).update(finished_at=timezone.now() - timedelta(hours=2))

    this_host = current_host()
    assert purge_expired_artifacts() == [old.pk]  # this host's
    assert PURGED.isdisjoint(os.listdir(task_dir(here)))
    assert not PURGED.isdisjoint(os.listdir(host_b_tasks / there))  # not this host's to reach

    settings.EXECGO_HOST_NAME, settings.EXECGO_TASKS_DIR = "host-b", str(host_b_tasks)
    assert purge_expired_artifacts() == [old.pk]
    assert PURGED.isdisjoint(os.listdir(host_b_tasks / there))
    assert (host_b_tasks / there / "result.json").exists()  # the small files stay
    assert purge_expired_artifacts() == []

    purges = list(AuditLog.objects.filter(run=old, event="artifacts_purged").order_by("pk"))
    assert [purge.data["host"] for purge in purges] == [this_host, "host-b"]
    assert all(path.startswith(str(host_b_tasks)) for path in purges[1].data["removed"])
    assert not any(path.startswith(str(host_b_tasks)) for path in purges[0].data["removed"])


def test_beat_sends_each_host_seen_lately_its_own_purge():
    purge_broker()
    for name in ("host-a", "host-b", "gone-host"):
        ledger.host_register(name, task_slots=1, memory_bytes=2**30, pids=10)
    HostCapacity.objects.filter(host="gone-host").update(last_seen=timezone.now().replace(year=2000))
    live = hosts_to_heal()
    assert {"host-a", "host-b"} <= set(live) and "gone-host" not in live

    purge_expired_run_artifacts()

    for name in live:
        [message] = queued(host_queue(name))
        assert message["task"] == "runs.tasks.purge_host_artifacts" and message["expires"] is not None
    assert queued(host_queue("gone-host")) == []
    assert "runs.tasks.purge_host_artifacts" in current_app.tasks  # the name beat's fan-out sends is a task
