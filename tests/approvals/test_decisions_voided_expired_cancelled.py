"""A pending approval request that ends without a verdict, through the
decision service: voided when the plan or the policy changed under it,
expired at expires_at (a decision after it is refused even before the expiry
ran) or by the sweeper, and cancelled with its run; each closes its run with
none of its steps started, and a later decision is refused."""

from datetime import timedelta

import pytest
from django.utils import timezone

from approvals.models import ApprovalRequest, Decision
from approvals.services import approval_decide, approval_expire
from policy.interface import current_policy_version
from policy.models import PolicyRule
from policy.rules import policy_rule_save
from runs.errors import ConflictError
from runs.models import Run, Step, Trace
from runs.services import run_cancel
from runs.sweeper import sweep_run
from tests.approvals.decisions_helpers import (
    assert_no_step_started,
    assert_refused,
    audit_events,
    fresh,
    path_of,
    pending_request,
)

pytestmark = pytest.mark.django_db


# --- 1. voiding -----------------------------------------------------------------------------------


def assert_voided(run: Run, request: ApprovalRequest, actor, *, approve: bool, reason: str) -> None:
    with pytest.raises(ConflictError) as voided:
        approval_decide(request=request, digest=request.action_digest, actor=actor, approve=approve)
    assert voided.value.http_status == 409
    assert voided.value.envelope["details"] == {"request": request.pk, "status": "voided"}
    assert reason in voided.value.envelope["message"]

    request = fresh(request)
    assert request.status == "voided" and request.decided_at is not None
    rows = list(audit_events(run, "approval_voided"))
    assert len(rows) == 1
    assert rows[0].actor_id == actor.pk and rows[0].data["request"] == request.pk
    assert reason in rows[0].data["reason"]
    assert not audit_events(run, "approval_approved").exists()
    assert not audit_events(run, "approval_rejected").exists()

    run = fresh(run)
    assert (run.state, run.closing_cause) == ("CLOSED_REJECTED", "rejected")
    assert "EXECUTING" not in path_of(run)
    assert path_of(run)[-4:] == ["AWAITING_HITL", "REJECTED", "TRACING", "CLOSED_REJECTED"]
    assert_no_step_started(run)
    assert not ApprovalRequest.objects.filter(run_id=run.pk, status="pending").exists()


@pytest.mark.parametrize("approve", [True, False], ids=["approve", "reject"])
def test_a_plan_changed_under_the_request_voids_it(awaiting, approver, approve):
    run = awaiting()
    request = pending_request(run)
    changed = Step.objects.filter(run_id=run.pk, step_id="install").update(
        params={"argv": ["pip", "install", "requests-but-not-quite"]})
    assert changed == 1

    assert_voided(run, request, approver, approve=approve, reason="the plan changed")


@pytest.mark.parametrize("approve", [True, False], ids=["approve", "reject"])
def test_a_policy_changed_under_the_request_voids_it(awaiting, approver, approve):
    run = awaiting()
    request = pending_request(run)
    rule = PolicyRule.objects.get(name="shell-chown")  # any rule: the version moves with every change
    rule.reason = "changes file ownership (reviewed)"
    policy_rule_save(rule)
    assert current_policy_version() == request.policy_version + 1

    assert_voided(run, request, approver, approve=approve, reason="the policy changed")


# --- 2. expiry ------------------------------------------------------------------------------------


def test_an_expired_request_rejects_its_run_at_expires_at(awaiting, approver):
    run = awaiting()
    request = pending_request(run)

    assert approval_expire(request.pk, now=request.expires_at - timedelta(seconds=1)) is False
    assert fresh(request).status == "pending"
    assert fresh(run).state == "AWAITING_HITL"
    assert not audit_events(run, "hitl_timeout").exists()
    assert not Trace.objects.filter(run_id=run.pk, kind="hitl_decision").exists()

    assert approval_expire(request.pk, now=request.expires_at + timedelta(seconds=1)) is True

    request = fresh(request)
    assert request.status == "expired"
    assert request.decided_at == request.expires_at + timedelta(seconds=1)
    rows = list(audit_events(run, "hitl_timeout"))
    assert len(rows) == 1 and rows[0].data["request"] == request.pk
    trace = Trace.objects.get(run_id=run.pk, kind="hitl_decision")
    assert trace.data["timeout"] is True and trace.data["decision"] == "reject"
    assert (trace.from_state, trace.to_state) == ("AWAITING_HITL", "TIMEOUT")
    assert trace.error["code"] == "timeout"
    run = fresh(run)
    assert (run.state, run.closing_cause) == ("CLOSED_REJECTED", "approval_timeout")
    assert path_of(run)[-4:] == ["AWAITING_HITL", "TIMEOUT", "TRACING", "CLOSED_REJECTED"]
    assert audit_events(run, "run_rejected").count() == 1
    assert_no_step_started(run)

    # A second delivery of the expiry changes nothing.
    assert approval_expire(request.pk, now=request.expires_at + timedelta(seconds=2)) is False
    assert audit_events(run, "hitl_timeout").count() == 1

    assert_refused(request, approver, approve=True, status="expired", reason="this request is expired")
    assert not Decision.objects.filter(request=request).exists()


def test_a_decision_after_expires_at_is_refused_even_before_the_expiry_ran(awaiting, approver):
    run = awaiting()
    request = pending_request(run)
    ApprovalRequest.objects.filter(pk=request.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    request = fresh(request)

    assert_refused(request, approver, approve=True, status="pending", reason="this request expired")
    assert fresh(run).state == "AWAITING_HITL"
    assert not Decision.objects.filter(request=request).exists()


def test_the_sweeper_expires_the_pending_request_of_a_run_stuck_awaiting_approval(awaiting, approver):
    run = awaiting()
    request = pending_request(run)

    assert sweep_run(run, age=timedelta(seconds=run.approval_timeout_s + 1)) is True

    request = fresh(request)
    assert request.status == "expired" and request.decided_at is not None
    run = fresh(run)
    assert (run.state, run.closing_cause) == ("CLOSED_REJECTED", "approval_timeout")
    trace = Trace.objects.get(run_id=run.pk, kind="hitl_decision")
    assert trace.data["timeout"] is True and trace.data["layer"] == "sweeper"
    assert audit_events(run, "zombie_recovered").count() == 1
    assert_no_step_started(run)
    assert approval_expire(request.pk, now=request.expires_at + timedelta(seconds=1)) is False
    assert_refused(request, approver, approve=True, status="expired", reason="this request is expired")


# --- 3. cancel while waiting ------------------------------------------------------------------------


def test_a_cancel_while_waiting_cancels_the_request(awaiting, agent, approver):
    run = awaiting()
    request = pending_request(run)

    returned = run_cancel(run=run, user=agent)

    assert returned.state == "CLOSED_CANCELLED"
    run = fresh(run)
    assert (run.state, run.closing_cause) == ("CLOSED_CANCELLED", "cancelled")
    assert path_of(run)[-4:] == ["AWAITING_HITL", "CANCELLED", "TRACING", "CLOSED_CANCELLED"]
    assert audit_events(run, "run_cancelled").get().actor_id == agent.pk
    request = fresh(request)
    assert request.status == "cancelled" and request.decided_at is not None
    assert_no_step_started(run)

    assert_refused(request, approver, approve=True, status="cancelled", reason="this request is cancelled")
    assert not Decision.objects.filter(request=request).exists()
    assert fresh(run).state == "CLOSED_CANCELLED"
