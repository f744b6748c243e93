"""The decision service of the approvals: the request a run opens on its way
into AWAITING_HITL, who may decide it, what a reject / an approval / a quorum
does, a decision on a request already settled, and a real race of an approve
against a reject (PostgreSQL). A request that ends without a verdict (voided,
expired, cancelled): test_decisions_voided_expired_cancelled.py."""

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from io import StringIO

import pytest
from celery.canvas import Signature
from django.core.management import call_command
from django.db import connection, connections

from approvals.models import (
    AGENTS_GROUP,
    APPROVERS_GROUP,
    ApprovalRequest,
    Decision,
    action_digest,
    normalised_action,
    shown_action,
)
from approvals.services import approval_decide, approval_expire
from policy.baseline import baseline_reasons, plan_baseline
from policy.interface import current_policy_version
from policy.models import PolicyRule
from policy.rules import policy_rule_save
from runs.dispatch import ADVANCE_RUN
from runs.errors import ConflictError, DeniedError
from runs.models import AuditLog, Job, Run, Step, Trace
from runs.services import run_cancel
from runtime.plan_resolver import resolve_plan
from tests.approvals.decisions_helpers import (
    APPROVAL_TIMEOUT_S,
    assert_no_step_started,
    assert_refused,
    audit_events,
    fresh,
    path_of,
    pending_request,
)
from tests.conftest import make_user, open_approval, postgres_only, purge_broker

pytestmark = pytest.mark.django_db

# What a default shell step's plan starts from, as the policy words it.
DEFAULT_BASELINE = baseline_reasons(plan_baseline(resolve_plan({}), worker_is_root=os.geteuid() == 0))[0]
INSTALL_REASON = "shell-package-install: installs packages (changes the host, runs third-party install scripts)"


# --- 1. the request a run opens ------------------------------------------------------------------


def test_a_high_risk_run_opens_exactly_one_request_bound_to_its_action(awaiting):
    run = awaiting()

    requests = list(ApprovalRequest.objects.filter(run_id=run.pk))
    assert len(requests) == 1
    request = requests[0]
    assert request.status == "pending"
    assert request.tenant_id == run.tenant_id
    assert request.risk == "high"
    assert request.approvals_required == 1
    assert request.decided_at is None

    policy = Trace.objects.get(run_id=run.pk, kind="policy_decision")
    assert policy.to_state == "AWAITING_HITL"
    assert policy.data["risk"] == "high"
    assert request.policy_version == policy.data["policy_version"] == current_policy_version()
    assert run.context["policy"]["policy_version"] == request.policy_version

    steps = list(Step.objects.filter(run_id=run.pk).order_by("position"))
    assert [step.step_id for step in steps] == ["prep", "install"]
    assert request.action_digest == action_digest(steps, request.policy_version)
    assert len(request.action_digest) == 64
    assert request.steps == [
        {"action": normalised_action(steps[0]), "shown": shown_action(steps[0]), "risk": "low",
         "reasons": [DEFAULT_BASELINE]},
        {"action": normalised_action(steps[1]), "shown": shown_action(steps[1]), "risk": "high",
         "reasons": [DEFAULT_BASELINE, INSTALL_REASON]},
    ]
    assert request.steps[1]["shown"]["argv"] == ["pip", "install", "requests"]
    # The plan a step was rated on is part of what the digest binds: any change of it is another action.
    assert steps[1].rated_plan["profile"] in ("linux_sandbox", "process")
    for weaker in ({"network": "internet"}, {"profile": "process", "namespaces": False}, {"uid": None},
                   {"limits": {**steps[1].rated_plan.get("limits", {}), "processes": None}}):
        steps[1].rated_plan = {**request.steps[1]["action"]["rated_plan"], **weaker}
        assert action_digest(steps, request.policy_version) != request.action_digest, weaker
    # The action as an approver reads it: the exact argv of each shell step.
    assert [(row["action"]["id"], row["action"]["tool"], row["action"]["argv"], row["action"]["depends_on"])
            for row in request.steps] == [("prep", "shell", ["echo", "ready"], []),
                                          ("install", "shell", ["pip", "install", "requests"], ["prep"])]
    assert [row["action"]["id"] for row in request.high_risk_steps] == ["install"]

    assert run.approval_timeout_s == APPROVAL_TIMEOUT_S
    waited = (request.expires_at - request.requested_at).total_seconds()
    assert abs(waited - APPROVAL_TIMEOUT_S) <= 1, waited

    rows = list(audit_events(run, "approval_requested"))
    assert len(rows) == 1
    assert rows[0].to_state == "AWAITING_HITL" and rows[0].caller == "hitl controller"
    assert rows[0].data["request"] == request.pk and rows[0].data["approvals_required"] == 1
    assert path_of(run)[-2:] == ["POLICY_CHECK", "AWAITING_HITL"]


# --- 2. reject and approve ---------------------------------------------------------------------


def test_a_reject_by_an_approver_closes_the_run_rejected(awaiting, approver):
    run = awaiting()
    request = pending_request(run)

    outcome = approval_decide(request=request, digest=request.action_digest, actor=approver, approve=False, comment="not on this host")

    assert outcome.request.status == "rejected" and outcome.approvals == 0
    request = fresh(request)
    assert request.status == "rejected" and request.decided_at is not None
    decisions = list(Decision.objects.filter(request=request))
    assert [(d.decider_id, d.decision, d.comment) for d in decisions] == [(approver.pk, "reject", "not on this host")]

    trace = Trace.objects.get(run_id=run.pk, kind="hitl_decision")
    assert trace.data["decision"] == "reject" and trace.data["approver"] == approver.pk
    assert trace.data["timeout"] is False and trace.data["final"] is True
    assert trace.data["comment"] == "not on this host"

    rejected = list(audit_events(run, "approval_rejected"))
    assert len(rejected) == 1 and rejected[0].actor_id == approver.pk
    assert rejected[0].data["comment"] == "not on this host"
    assert not audit_events(run, "approval_approved").exists()

    run = fresh(run)
    assert (run.state, run.closing_cause) == ("CLOSED_REJECTED", "rejected")
    assert path_of(run)[-4:] == ["AWAITING_HITL", "REJECTED", "TRACING", "CLOSED_REJECTED"]
    assert audit_events(run, "run_rejected").count() == 1
    assert_no_step_started(run)


def test_an_approval_moves_the_run_to_executing_and_sends_its_task_after_commit(
        awaiting, approver, django_capture_on_commit_callbacks, monkeypatch):
    run = awaiting()
    request = pending_request(run)

    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        outcome = approval_decide(request=request, digest=request.action_digest, actor=approver, approve=True, comment="ok")

    assert outcome.request.status == "approved" and outcome.approvals == 1
    request = fresh(request)
    assert request.status == "approved" and request.decided_at is not None
    assert list(Decision.objects.filter(request=request).values_list("decider_id", "decision", "comment")) == [
        (approver.pk, "approve", "ok")]
    trace = Trace.objects.get(run_id=run.pk, kind="hitl_decision")
    assert (trace.data["decision"], trace.data["approver"], trace.data["final"]) == ("approve", approver.pk, True)
    assert audit_events(run, "approval_approved").get().actor_id == approver.pk

    run = fresh(run)
    assert run.state == "EXECUTING" and run.executing_started_at is not None
    assert path_of(run)[-2:] == ["AWAITING_HITL", "EXECUTING"]
    # Nothing ran yet: the task that executes the run is only sent after commit.
    assert_no_step_started(run)

    sent = []
    monkeypatch.setattr(Signature, "apply_async", lambda self, *args, **kwargs: sent.append((self.task, self.args)))
    for callback in callbacks:
        callback()
    assert (ADVANCE_RUN, (run.pk,)) in sent, sent


# --- 3. who may not decide ------------------------------------------------------------------------


def assert_denied(request: ApprovalRequest, actor, reason: str) -> None:
    with pytest.raises(DeniedError) as denied:
        approval_decide(request=request, digest=request.action_digest, actor=actor, approve=True)
    assert denied.value.http_status == 403
    assert denied.value.envelope["code"] == "denied"
    assert denied.value.envelope["source"] == "approval"
    assert reason in denied.value.envelope["message"]
    assert not Decision.objects.filter(request_id=request.pk).exists()
    assert fresh(request).status == "pending"
    assert Run.objects.get(pk=request.run_id).state == "AWAITING_HITL"


def test_the_submitter_may_not_decide_its_own_run(awaiting, tenant):
    # An approver who submitted the run themselves: separation of duties, not the group, refuses them.
    submitter = make_user("self-approver", tenant, groups=(APPROVERS_GROUP,))
    run = awaiting(user=submitter)
    assert run.submitted_by_id == submitter.pk
    assert_denied(pending_request(run), submitter, "separation of duties")


def test_the_submitting_agent_may_not_decide(awaiting, agent):
    run = awaiting()
    assert_denied(pending_request(run), agent, "an agent identity never decides")


def test_an_agent_identity_may_not_decide_even_in_the_approvers_group(awaiting, tenant):
    bot = make_user("bot", tenant, groups=(AGENTS_GROUP, APPROVERS_GROUP))
    assert_denied(pending_request(awaiting()), bot, "an agent identity never decides")


def test_an_approver_of_another_tenant_may_not_decide(awaiting, other_tenant):
    foreign = make_user("foreign-approver", other_tenant, groups=(APPROVERS_GROUP,))
    assert_denied(pending_request(awaiting()), foreign, "another tenant")


def test_a_user_outside_the_approvers_group_may_not_decide(awaiting, tenant):
    bystander = make_user("bystander", tenant)
    assert_denied(pending_request(awaiting()), bystander, "only members of the approvers group")


def test_the_same_approver_twice_on_a_quorum_of_two_is_refused_and_audited(make_run, approver):
    request = open_approval(make_run("AWAITING_HITL", previous_state="POLICY_CHECK"), approvals_required=2)
    approval_decide(request=request, digest=request.action_digest, actor=approver, approve=True)

    assert_refused(request, approver, approve=True, status="pending", reason="you already decided")
    assert_refused(request, approver, approve=False, status="pending", reason="you already decided")
    request = fresh(request)
    assert request.status == "pending"
    assert list(request.decisions.values_list("decider_id", "decision")) == [(approver.pk, "approve")]
    assert Run.objects.get(pk=request.run_id).state == "AWAITING_HITL"


def _approved(request, approver):
    approval_decide(request=request, digest=request.action_digest, actor=approver, approve=True)


def _rejected(request, approver):
    approval_decide(request=request, digest=request.action_digest, actor=approver, approve=False, comment="no")


def _expired(request, approver):
    assert approval_expire(request.pk, now=request.expires_at + timedelta(seconds=1)) is True


def _cancelled(request, approver):
    run_cancel(run=Run.objects.get(pk=request.run_id), user=request.run.submitted_by)


@pytest.mark.parametrize("status,settle", [
    ("approved", _approved), ("rejected", _rejected), ("expired", _expired), ("cancelled", _cancelled),
])
@pytest.mark.parametrize("approve", [True, False], ids=["approve", "reject"])
def test_a_decision_on_a_settled_request_is_refused_and_audited(awaiting, approver, second_approver, status, settle,
                                                                 approve):
    run = awaiting()
    request = pending_request(run)
    settle(request, approver)
    assert fresh(request).status == status
    state = fresh(run).state
    decisions = Decision.objects.filter(request=request).count()

    assert_refused(request, second_approver, approve=approve, status=status, reason=f"this request is {status}")

    assert fresh(request).status == status
    assert fresh(run).state == state
    assert Decision.objects.filter(request=request).count() == decisions


# --- 4. quorum ------------------------------------------------------------------------------------


def test_a_quorum_of_two_from_a_seeded_rule_needs_two_distinct_approvers(awaiting, approver, second_approver):
    rule = PolicyRule.objects.get(name="shell-package-install")
    rule.approvals_required = 2
    before = current_policy_version()
    policy_rule_save(rule)
    assert current_policy_version() == before + 1
    run = awaiting()
    request = pending_request(run)
    assert request.approvals_required == 2
    assert request.policy_version == current_policy_version()

    first = approval_decide(request=request, digest=request.action_digest, actor=approver, approve=True, comment="one")
    assert first.approvals == 1 and first.request.status == "pending"
    request = fresh(request)
    assert request.status == "pending" and request.decided_at is None and request.approvals_so_far == 1
    assert fresh(run).state == "AWAITING_HITL"
    trace = Trace.objects.get(run_id=run.pk, kind="hitl_decision")
    assert (trace.data["approvals"], trace.data["approvals_required"], trace.data["final"]) == (1, 2, False)

    assert_refused(request, approver, approve=True, status="pending", reason="you already decided")
    assert fresh(request).approvals_so_far == 1

    second = approval_decide(request=request, digest=request.action_digest, actor=second_approver, approve=True, comment="two")
    assert second.approvals == 2 and second.request.status == "approved"
    request = fresh(request)
    assert request.status == "approved" and request.decided_at is not None
    assert sorted(request.decisions.values_list("decider_id", flat=True)) == sorted([approver.pk, second_approver.pk])
    assert audit_events(run, "approval_approved").count() == 2
    assert fresh(run).state == "EXECUTING"
    assert path_of(run)[-2:] == ["AWAITING_HITL", "EXECUTING"]


def test_a_quorum_of_two_with_one_approval_then_one_reject_is_rejected(make_run, approver, second_approver):
    run = make_run("AWAITING_HITL", previous_state="POLICY_CHECK")
    request = open_approval(run, approvals_required=2)
    assert request.approvals_required == 2

    assert approval_decide(request=request, digest=request.action_digest, actor=approver, approve=True).request.status == "pending"
    assert fresh(run).state == "AWAITING_HITL"
    outcome = approval_decide(request=request, digest=request.action_digest, actor=second_approver, approve=False, comment="no")

    assert outcome.request.status == "rejected"
    request = fresh(request)
    assert request.status == "rejected"
    assert list(request.decisions.values_list("decider_id", "decision")) == [
        (approver.pk, "approve"), (second_approver.pk, "reject")]
    run = fresh(run)
    assert (run.state, run.closing_cause) == ("CLOSED_REJECTED", "rejected")
    assert audit_events(run, "approval_rejected").get().actor_id == second_approver.pk


# --- 5. approve against reject, for real (PostgreSQL) ------------------------------------------------

RACES = 200


def _decide_racing(barrier: threading.Barrier, request_pk: int, actor, approve: bool):
    """One contender on its own connection; "won", or the ConflictError it lost with."""
    try:
        request = ApprovalRequest.objects.select_related("run").get(pk=request_pk)  # connects before the barrier
        barrier.wait(timeout=10)
        approval_decide(request=request, digest=request.action_digest, actor=actor, approve=approve,
                        comment="" if approve else "racing the approval")
        return "won"
    except ConflictError as exc:
        return exc
    finally:
        connection.close()
        connections.close_all()


@postgres_only
@pytest.mark.django_db(transaction=True, databases=["default", "audit"])
def test_an_approve_racing_a_reject_has_exactly_one_winner(make_run, approver, second_approver):
    requests = []
    for _ in range(RACES):
        run = make_run("AWAITING_HITL", previous_state="POLICY_CHECK")
        Job.objects.filter(pk=run.job_id).update(status="running")
        requests.append(open_approval(run))

    try:
        winners = {}
        for request in requests:
            barrier = threading.Barrier(2)
            with ThreadPoolExecutor(max_workers=2) as pool:
                approving = pool.submit(_decide_racing, barrier, request.pk, approver, True)
                rejecting = pool.submit(_decide_racing, barrier, request.pk, second_approver, False)
                outcomes = {"approve": approving.result(timeout=30), "reject": rejecting.result(timeout=30)}
            won = [name for name, outcome in outcomes.items() if outcome == "won"]
            assert len(won) == 1, f"request {request.pk}: {outcomes}"
            lost = outcomes["reject" if won == ["approve"] else "approve"]
            assert isinstance(lost, ConflictError) and lost.http_status == 409, lost
            winners[request.pk] = won[0]

        by_request = {}
        for request_id, decider_id, decision in Decision.objects.filter(
                request_id__in=winners).values_list("request_id", "decider_id", "decision"):
            by_request.setdefault(request_id, []).append((decider_id, decision))
        for request in requests:
            winner = winners[request.pk]
            expected = (approver.pk, "approve") if winner == "approve" else (second_approver.pk, "reject")
            loser = second_approver if winner == "approve" else approver
            assert by_request.get(request.pk) == [expected], request.pk
            request = fresh(request)
            assert request.status == ("approved" if winner == "approve" else "rejected"), request.pk
            run = Run.objects.get(pk=request.run_id)
            assert run.state == ("EXECUTING" if winner == "approve" else "CLOSED_REJECTED"), request.pk
            refusals = list(AuditLog.objects.filter(run_id=run.pk, event="approval_refused"))
            assert [row.actor_id for row in refusals] == [loser.pk], request.pk
            assert Trace.objects.filter(run_id=run.pk, kind="hitl_decision").count() == 1
        assert Decision.objects.filter(request_id__in=winners).count() == RACES

        out = StringIO()
        call_command("execgo_reconcile", stdout=out, stderr=StringIO())
        assert "all invariants hold" in out.getvalue(), out.getvalue()
    finally:
        purge_broker()  # the approved runs' advance tasks
