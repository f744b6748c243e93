"""Reminders and escalation on real timings: a real worker and beat (its
reminder scan every second), a request of 30 s with reminders at 20% and
40% of it and escalation after 5 s. Each notification is made within a few
seconds of its moment; the escalation group's member then decides, with
a quarter of a minute to spare."""

import sys
from datetime import timedelta

import pytest

from approvals.models import ApprovalRequest, Notification
from approvals.services import approval_decide
from runs.models import Tenant
from tests.conftest import WorkerProcess, log_tails, make_person, token_client, wait_for_run, wait_until
from tests.reliability.stack import Service

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("echo_pip_install_is_high")]

PLAN = {"steps": [{"id": "install", "tool": "shell", "params": {"script": "echo pip install --dry-run nothing"}}]}
SLACK_S = 6.0  # the scan's second, beat's own tick and a busy machine's scheduling: generous



def test_reminders_and_escalation_come_within_seconds_of_their_moments(seeded_policy, tenant, agent, tmp_path):
    Tenant.objects.filter(pk=tenant.pk).update(approval_escalation_after_s=5, approval_reminder_fractions=[0.2, 0.4])
    make_person("ann", tenant, "approvers")
    esme = make_person("esme", tenant, "escalation")
    env = {"EXECGO_REMINDER_SCAN_INTERVAL_S": "1"}
    worker = WorkerProcess(hostname="reminders", env=env).start()
    beat = Service("beat", [sys.executable, "-m", "celery", "-A", "execgo", "beat", "-l", "INFO", "--schedule",
                            str(tmp_path / "beat-schedule")], env, tmp_path)
    try:
        response = token_client(agent).post("/api/v1/runs", {"title": "remind me", "plan": PLAN,
                                                             "approval_timeout_s": 30}, format="json")
        assert response.status_code == 201, response.content
        run_id = response.json()["id"]
        wait_until(lambda: Notification.objects.filter(request__run_id=run_id, kind="reminder").count() == 2,
                   timeout=60, what="two reminders")
        request = ApprovalRequest.objects.get(run_id=run_id)
        span = request.expires_at - request.requested_at
        moments = {"escalation": [request.requested_at + timedelta(seconds=5)],
                   "reminder": [request.requested_at + span * 0.2, request.requested_at + span * 0.4]}
        for kind, expected in moments.items():
            made = sorted(Notification.objects.filter(request=request, kind=kind).values_list("created_at",
                                                                                                flat=True))
            assert len(made) == len(expected), (kind, made)
            for at, due in zip(made, expected):
                late = (at - due).total_seconds()
                print(f"{kind} made {late:+.2f} s from its moment")
                assert 0 <= late < SLACK_S, (kind, late)
        assert approval_decide(request=request, actor=esme, approve=True, digest=request.action_digest,
                               comment="escalated to me").request.status == "approved"
        assert wait_for_run(run_id, timeout=60).state == "SUCCEEDED"
    except (AssertionError, pytest.fail.Exception) as exc:
        raise AssertionError(f"{exc}{log_tails(worker)}\n--- beat ---\n{beat.log_path.read_text()[-3000:]}") from exc
    finally:
        beat.stop()
        worker.stop()
