"""Expiry at the minute, with a real worker: a request nobody decides closes
its run rejected at expires_at itself (the expiry is sent with eta), not at
the next sweep, and nothing of the run ever ran."""

import statistics
import time

import pytest
from django.conf import settings

from approvals.models import ApprovalRequest
from runs.models import AuditLog, Run, Step
from runs.services import run_submit
from tests.conftest import simple_plan, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("echo_pip_install_is_high")]

RUNS = 50
EXPIRY_S = 2
SUBMIT_EVERY_S = 0.04


def test_fifty_requests_expire_promptly_after_their_expiry(celery_worker, seeded_policy, tenant, agent):
    run_ids = []
    started = time.time()
    for _ in range(RUNS):
        run_ids.append(run_submit(tenant=tenant, user=agent, plan=simple_plan(["echo", "pip", "install", "nothing"]),
                                  approval_timeout_s=EXPIRY_S).run.pk)
        # About the rate a 2-slot worker takes runs to AWAITING_HITL: a burst
        # of 50 would still be in PREPARING when the first ones expire.
        time.sleep(SUBMIT_EVERY_S)

    wait_until(lambda: Run.objects.filter(pk__in=run_ids, state="CLOSED_REJECTED").count() == RUNS, timeout=90,
               what=f"{RUNS} expired runs")

    requests = list(ApprovalRequest.objects.filter(run_id__in=run_ids).select_related("run"))
    assert len(requests) == RUNS
    lateness = []
    for request in requests:
        assert request.status == "expired"
        assert request.run.closing_cause == "approval_timeout"
        lateness.append((request.run.finished_at - request.expires_at).total_seconds())
    # Generous bounds (the figure itself is a bench's): about 1 s on a quiet
    # machine, up to 5.4 s for the last of the fifty with the suite's parallel
    # processes busy, as the 50 closings queue on two pool processes. Nothing
    # polls here (no beat runs), and a timer sent for the wrong time would
    # miss by minutes.
    assert min(lateness) >= 0, f"a run closed {-min(lateness):.2f}s before its request expired"
    assert statistics.median(lateness) <= 5.0, f"the median closing was {statistics.median(lateness):.2f}s late"
    assert max(lateness) <= 15.0, f"a run closed {max(lateness):.2f}s after its request expired"
    assert AuditLog.objects.filter(run_id__in=run_ids, event="hitl_timeout").count() == RUNS
    assert not AuditLog.objects.filter(run_id__in=run_ids, event="zombie_detected").exists()  # not the sweeper
    # Nothing of these runs ran: no step started, no task directory exists.
    assert not Step.objects.filter(run_id__in=run_ids).exclude(run_status="").exists()
    handles = Step.objects.filter(run_id__in=run_ids).exclude(handle_id="").values_list("handle_id", flat=True)
    assert not list(handles)
    # (Directories of earlier tests may carry the same step ids: a flushed SQLite table reuses them.)
    assert not [path for path in settings.EXECGO_TASKS_DIR.glob("*")
                if path.stat().st_mtime >= started and path.name.startswith(tuple(f"h-{step}-" for step in
                                              Step.objects.filter(run_id__in=run_ids).values_list("pk", flat=True)))]
