"""execgo_reconcile: silent and exit 0 when the invariants of
docs/state-machine.md#reconciliation-invariants hold, exit 1 with one line
per violation when they do not."""

import subprocess
import sys
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import transaction

from runs.audit import audit
from runs.models import AuditLog, Job, Run, Trace, TraceKind
from runs.services import run_cancel, run_retry, run_submit
from tests.conftest import ROOT, _worker_env, simple_plan

OK_LINE = "reconcile: all invariants hold"


def reconcile() -> tuple[int, list[str]]:
    out = StringIO()
    try:
        call_command("execgo_reconcile", stdout=out, stderr=StringIO())
    except SystemExit as exit_:
        code = exit_.code
    else:
        code = 0
    return code, out.getvalue().splitlines()


@pytest.fixture
def closed_run(make_run):
    """A final run with the rows the kernel would have written for it:
    its final transition trace, its one final audit event and the Job
    projection. Each keyword argument replaces one of them with a wrong one."""

    def factory(state: str, cause: str, *, final_events: tuple[str, ...] | None = None,
                entered_from: str | None = "TRACING", job_status: str | None = None) -> Run:
        run = make_run(state, previous_state=entered_from or "", closing_cause=cause)
        if entered_from is not None:
            Trace.objects.create(run=run, kind=TraceKind.TRANSITION, from_state=entered_from, to_state=state)
        default_event = {"SUCCEEDED": "run_succeeded", "CLOSED_FAILED": "run_failed",
                         "CLOSED_REJECTED": "run_rejected", "CLOSED_CANCELLED": "run_cancelled"}[state]
        for event in (default_event,) if final_events is None else final_events:
            audit(event, run_id=run.pk, tenant_id=run.tenant_id, from_state="TRACING", to_state=state)
        default_status = "done" if state == "SUCCEEDED" else "failed"
        Job.objects.filter(pk=run.job_id).update(status=job_status or default_status)
        return run

    return factory


@pytest.mark.django_db
def test_clean_database_passes():
    assert reconcile() == (0, [OK_LINE])


@pytest.mark.django_db
def test_well_formed_final_runs_pass(closed_run, make_run):
    closed_run("SUCCEEDED", "succeeded")
    closed_run("CLOSED_FAILED", "run_timeout")
    closed_run("CLOSED_REJECTED", "approval_timeout")
    closed_run("CLOSED_CANCELLED", "cancelled")
    live = make_run("EXECUTING")  # no final event yet, and none expected
    Job.objects.filter(pk=live.job_id).update(status="running")

    assert reconcile() == (0, [OK_LINE])


@pytest.mark.django_db(transaction=True)
def test_runs_driven_through_the_pipeline_pass(settings, tenant, agent, make_run):
    # The advance task runs inline at commit, so run_submit returns with the
    # run already driven through every stage by runs.pipeline.run_advance.
    settings.CELERY_TASK_ALWAYS_EAGER = True
    settings.CELERY_TASK_EAGER_PROPAGATES = True

    succeeded = run_submit(tenant=tenant, user=agent, plan=simple_plan(["true"], ["echo", "ok"])).run
    failed = run_submit(tenant=tenant, user=agent, plan=simple_plan(["true"], ["false"])).run
    with transaction.atomic():
        # Cancelled before the worker gets it: EXECUTING sees the request.
        stopped = run_submit(tenant=tenant, user=agent, plan=simple_plan(["true"])).run
        run_cancel(run=stopped, user=agent)
    retried = run_retry(run=Run.objects.get(pk=failed.pk), user=agent)
    waiting = make_run("AWAITING_HITL", previous_state="POLICY_CHECK")
    run_cancel(run=waiting, user=agent)

    states = dict(Run.objects.values_list("pk", "state"))
    assert states == {
        succeeded.pk: "SUCCEEDED", failed.pk: "CLOSED_FAILED", stopped.pk: "CLOSED_CANCELLED",
        retried.pk: "CLOSED_FAILED", waiting.pk: "CLOSED_CANCELLED",
    }
    assert Job.objects.get(pk=failed.job_id).latest_run_id == retried.pk
    assert AuditLog.objects.filter(event="run_succeeded").count() == 1

    assert reconcile() == (0, [OK_LINE])


@pytest.mark.django_db
def test_succeeded_run_without_run_succeeded(closed_run):
    run = closed_run("SUCCEEDED", "succeeded", final_events=())

    assert reconcile() == (1, [
        "VIOLATION: 1 SUCCEEDED runs but 0 run_succeeded audit events",
        f"VIOLATION: run {run.pk} is SUCCEEDED but has final audit events none",
    ])


@pytest.mark.django_db
def test_final_run_with_two_final_audit_events(closed_run):
    twice = closed_run("CLOSED_FAILED", "failed", final_events=("run_failed", "run_failed"))
    mixed = closed_run("CLOSED_CANCELLED", "cancelled", final_events=("run_cancelled", "run_failed"))

    assert reconcile() == (1, [
        f"VIOLATION: run {twice.pk} is CLOSED_FAILED but has final audit events {{'run_failed': 2}}",
        f"VIOLATION: run {mixed.pk} is CLOSED_CANCELLED but has final audit events "
        f"{{'run_cancelled': 1, 'run_failed': 1}}",
    ])


@pytest.mark.django_db
def test_final_run_that_never_passed_tracing(closed_run):
    skipped = closed_run("CLOSED_CANCELLED", "cancelled", entered_from="CANCELLED")
    untraced = closed_run("CLOSED_REJECTED", "rejected", entered_from=None)

    assert reconcile() == (1, [
        f"VIOLATION: run {skipped.pk} is CLOSED_CANCELLED but did not pass TRACING (entered from CANCELLED)",
        f"VIOLATION: run {untraced.pk} is CLOSED_REJECTED but did not pass TRACING (entered from nowhere)",
    ])


@pytest.mark.django_db
def test_job_status_that_disagrees_with_its_latest_run(closed_run):
    run = closed_run("SUCCEEDED", "succeeded", job_status="running")

    assert reconcile() == (1, [f"VIOLATION: job {run.job_id} reads 'running' but its latest run is SUCCEEDED"])


@pytest.mark.django_db
def test_final_audit_event_of_a_run_that_is_not_final(make_run):
    run = make_run("EXECUTING")
    Job.objects.filter(pk=run.job_id).update(status="running")
    audit("run_succeeded", run_id=run.pk, tenant_id=run.tenant_id)

    assert reconcile() == (1, [
        "VIOLATION: 0 SUCCEEDED runs but 1 run_succeeded audit events",
        f"VIOLATION: run {run.pk} has final audit events {{'run_succeeded': 1}} but is not final",
    ])


@pytest.mark.django_db(transaction=True)
def test_command_process_exit_status_and_output(closed_run):
    def manage_reconcile() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "manage.py", "execgo_reconcile"], cwd=ROOT, env=_worker_env(),
                              capture_output=True, timeout=120)

    closed_run("SUCCEEDED", "succeeded")
    clean = manage_reconcile()
    assert (clean.returncode, clean.stdout) == (0, f"{OK_LINE}\n".encode()), clean.stderr

    broken = closed_run("CLOSED_FAILED", "failed", final_events=(), entered_from="FAILED", job_status="running")
    result = manage_reconcile()
    assert result.returncode == 1, result.stderr
    assert result.stdout.decode().splitlines() == [
        f"VIOLATION: run {broken.pk} is CLOSED_FAILED but has final audit events none",
        f"VIOLATION: run {broken.pk} is CLOSED_FAILED but did not pass TRACING (entered from FAILED)",
        f"VIOLATION: job {broken.job_id} reads 'running' but its latest run is CLOSED_FAILED",
    ]
    assert result.stderr.strip().endswith(b"3 violation(s)")
