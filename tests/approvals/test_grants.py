"""Standing grants: "approve, and allow this same action for this agent for
N hours". A grant lets exactly the same action of the same agent go on
without waiting — not a one-character variant, not the same action with
another sandbox, not another agent's — until it expires or is revoked
(at once); it is refused where one person's approval is not enough.
(In Chromium: tests/pages/test_approvals_browser.py.)"""

from datetime import timedelta

import pytest
from django.utils import timezone

from approvals.models import ApprovalRequest, StandingGrant
from approvals.services import approval_decide
from policy.models import PolicyRule
from policy.rules import policy_rule_save
from runs.errors import ExecGoError
from runs.models import AuditLog, Run, Trace
from runs.pipeline import run_advance
from runs.services import run_submit
from tests.approvals.decisions_helpers import PLAN, pending_request
from tests.approvals.interfaces_helpers import error_of
from tests.conftest import make_user, token_client

pytestmark = pytest.mark.django_db


def plan(argv=("pip", "install", "requests"), sandbox=None) -> dict:
    install = {"id": "install", "tool": "shell", "params": {"argv": list(argv)}, "depends_on": ["prep"]}
    if sandbox:
        install["sandbox"] = sandbox
    return {"steps": [PLAN["steps"][0], install]}


def rated(tenant, agent, **kwargs) -> Run:
    """A run submitted and driven through POLICY_CHECK (nothing is sent: no commit)."""
    run = run_submit(tenant=tenant, user=agent, plan=plan(**kwargs)).run
    run_advance(run.pk)
    run.refresh_from_db()
    return run


def approve(user, request: ApprovalRequest, **body):
    return token_client(user).post(f"/api/v1/approvals/{request.pk}/approve",
                                   {"digest": request.action_digest, **body}, format="json")


@pytest.fixture
def granted(seeded_policy, tenant, agent, approver):
    """The install step of the first run allowed again for 2 hours."""
    run = rated(tenant, agent)
    assert run.state == "AWAITING_HITL"
    answer = approve(approver, pending_request(run), grant_hours=2)
    assert answer.status_code == 200, answer.content
    return StandingGrant.objects.get()


def test_an_approval_with_hours_grants_the_high_risk_step_and_the_same_action_then_runs_without_waiting(
        granted, tenant, agent, approver):
    assert (granted.agent, granted.granted_by, granted.action["argv"]) == (agent, approver,
                                                                          ["pip", "install", "requests"])
    assert timedelta(hours=1, minutes=59) < granted.expires_at - timezone.now() <= timedelta(hours=2)
    assert AuditLog.objects.filter(event="grant_created", data__grants=[granted.pk]).count() == 1

    again = rated(tenant, agent)
    assert again.state == "EXECUTING"
    assert not ApprovalRequest.objects.filter(run=again).exists()
    [applied] = AuditLog.objects.filter(event="grant_applied", run_id=again.pk)
    assert applied.data["grants"] == [{"step": "install", "grant": granted.pk, "granted_by": approver.username,
                                       "request": granted.request_id, "expires_at": granted.expires_at.isoformat()}]
    decision = Trace.objects.get(run=again, kind="policy_decision")
    assert decision.data["risk"] == "high" and decision.data["standing_grants"][0]["grant"] == granted.pk
    granted.refresh_from_db()
    assert granted.uses == 1 and granted.last_used_at is not None


@pytest.mark.parametrize("variant", [
    {"argv": ("pip", "install", "requestz")},  # one character
    {"argv": ("pip", "install", "requests ")},
    {"argv": ("pip", "install", "requests", "--upgrade")},
    {"sandbox": {"network": "internet"}},  # the same action with another sandbox
    {"sandbox": {"limits": {"cpu_seconds": 30}}},
])
def test_a_variant_of_the_granted_action_waits_for_a_person(granted, tenant, agent, variant):
    run = rated(tenant, agent, **variant)
    assert run.state == "AWAITING_HITL", variant
    assert not AuditLog.objects.filter(event="grant_applied", run_id=run.pk).exists()
    assert StandingGrant.objects.get().uses == 0


def test_another_agent_s_same_action_waits(granted, tenant):
    other = make_user("agent-2", tenant, groups=("agents",))
    assert rated(tenant, other).state == "AWAITING_HITL"


def test_a_revoked_grant_stops_at_once_and_an_expired_one_too(granted, tenant, agent, approver, other_tenant):
    outsider = make_user("globex-approver", other_tenant, groups=("approvers",))
    assert token_client(outsider).post(f"/api/v1/approvals/grants/{granted.pk}/revoke").status_code == 404
    assert rated(tenant, agent).state == "EXECUTING"

    revoked = token_client(approver).post(f"/api/v1/approvals/grants/{granted.pk}/revoke")
    assert revoked.status_code == 200, revoked.content
    assert (revoked.json()["live"], revoked.json()["revoked_by"]) == (False, approver.username)
    assert rated(tenant, agent).state == "AWAITING_HITL"
    assert AuditLog.objects.filter(event="grant_revoked", data__grant=granted.pk).count() == 1
    error_of(token_client(approver).post(f"/api/v1/approvals/grants/{granted.pk}/revoke"), 409, "invalid_input")

    second = rated(tenant, agent)
    answer = approve(approver, pending_request(second), grant_hours=1)
    assert answer.status_code == 200
    StandingGrant.objects.filter(revoked_at__isnull=True).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert rated(tenant, agent).state == "AWAITING_HITL"
    listed = token_client(approver).get("/api/v1/approvals/grants").json()
    assert [(row["id"], row["live"]) for row in listed] == [(granted.pk + 1, False), (granted.pk, False)]
    assert token_client(outsider).get("/api/v1/approvals/grants").json() == []
    assert token_client(agent).get("/api/v1/approvals/grants").status_code == 403


def test_a_grant_stops_applying_when_a_rule_now_needs_two_approvers(granted, tenant, agent):
    rule = PolicyRule.objects.get(name="shell-package-install")
    rule.approvals_required = 2
    policy_rule_save(rule)
    assert rated(tenant, agent).state == "AWAITING_HITL"


@pytest.mark.parametrize("case", ["reject", "edits", "two-approvers", "over-the-cap", "off-in-tenant", "zero"])
def test_a_grant_that_cannot_be_given_is_refused_and_nothing_is_decided(seeded_policy, tenant, agent, approver,
                                                                        case):
    request = pending_request(rated(tenant, agent))
    body = {"grant_hours": 2}
    if case == "reject":  # the service's own check (the API's reject takes no grant_hours)
        with pytest.raises(ExecGoError) as refused:
            approval_decide(request=request, actor=approver, approve=False, digest=request.action_digest,
                            comment="no", grant_hours=2)
        assert refused.value.envelope["details"]["fields"] == {
            "grant_hours": ["a standing grant comes with an approval only"]}
    else:
        if case == "edits":
            body["edits"] = {"install": {"argv": ["pip", "install", "--dry-run", "requests"]}}
        elif case == "two-approvers":
            ApprovalRequest.objects.filter(pk=request.pk).update(approvals_required=2)
        elif case == "over-the-cap":
            body["grant_hours"] = 9
        elif case == "off-in-tenant":
            type(tenant).objects.filter(pk=tenant.pk).update(standing_grant_max_hours=0)
        elif case == "zero":
            body["grant_hours"] = 0
        assert "grant_hours" in error_of(approve(approver, request, **body), 400, "invalid_input")["details"]["fields"]
    assert ApprovalRequest.objects.get(pk=request.pk).status == "pending"
    assert not StandingGrant.objects.exists() and not request.decisions.exists()
