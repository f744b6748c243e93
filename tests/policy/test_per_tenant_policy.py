"""Per-tenant policy: a tenant's rules rate its own runs only, its version
moves alone (so a change voids only its own pending requests), a global
rule moves every tenant's version, and a tenant's staff edit their own
rules in the admin while the global ones stay the superuser's."""

import pytest
from django.contrib.auth.models import Permission, User
from django.urls import reverse

from approvals.models import ApprovalRequest
from approvals.services import approval_decide
from policy.interface import current_policy_version, policy_dry_run
from policy.models import PolicyRule, PolicyVersion, TenantPolicyVersion
from policy.rules import policy_rule_delete, policy_rule_save
from runs.errors import ConflictError
from runs.models import Run
from tests.approvals.conftest import approver, awaiting  # noqa: F401 (fixtures)
from tests.approvals.decisions_helpers import pending_request
from tests.conftest import make_user

pytestmark = pytest.mark.django_db

PLAN = {"steps": [{"id": "s", "tool": "shell", "params": {"argv": ["echo", "deploy", "prod"]}}]}


def tenant_rule(tenant, name="deploys-need-a-human", pattern=r"\bdeploy\b", outcome="high") -> PolicyRule:
    return policy_rule_save(PolicyRule(tenant=tenant, name=name, tool="shell", field="command", pattern=pattern,
                                       outcome=outcome, reason="a deploy needs a human here"))


def test_a_tenant_s_rule_rates_its_own_runs_only(seeded_policy, tenant, other_tenant):
    assert policy_dry_run(plan=PLAN, tenant=tenant).risk == "low"
    tenant_rule(tenant)
    ours, theirs = policy_dry_run(plan=PLAN, tenant=tenant), policy_dry_run(plan=PLAN, tenant=other_tenant)
    assert ours.risk == "high" and [m["rule"] for m in ours.data["matched_rules"]] == ["deploys-need-a-human"]
    assert theirs.risk == "low" and theirs.data["matched_rules"] == []
    # A global rule rates both.
    policy_rule_save(PolicyRule(name="no-prod", tool="shell", field="command", pattern=r"\bprod\b", outcome="deny",
                                reason="nothing touches prod"))
    assert policy_dry_run(plan=PLAN, tenant=other_tenant).risk == "deny"


def test_versions_move_per_tenant_and_a_global_change_moves_them_all(seeded_policy, tenant, other_tenant):
    start = current_policy_version()
    assert current_policy_version(tenant.pk) == current_policy_version(other_tenant.pk) == start

    rule = tenant_rule(tenant)
    assert (current_policy_version(tenant.pk), current_policy_version(other_tenant.pk), current_policy_version()) \
        == (start + 1, start, start)
    rule.outcome = "deny"
    policy_rule_save(rule)
    assert current_policy_version(tenant.pk) == start + 2 and current_policy_version(other_tenant.pk) == start

    policy_rule_save(PolicyRule(name="global-x", tool="shell", field="command", pattern="x", outcome="medium",
                                reason="r"))
    assert (current_policy_version(tenant.pk), current_policy_version(other_tenant.pk), current_policy_version()) \
        == (start + 3, start + 1, start + 1)
    policy_rule_delete(rule)
    assert (current_policy_version(tenant.pk), current_policy_version(other_tenant.pk)) == (start + 4, start + 1)
    assert TenantPolicyVersion.objects.filter(tenant=tenant).count() == 1
    assert PolicyVersion.objects.count() == 1


def test_moving_a_rule_to_another_tenant_moves_both_versions(seeded_policy, tenant, other_tenant):
    rule = tenant_rule(tenant)
    before = current_policy_version(tenant.pk), current_policy_version(other_tenant.pk)
    rule.tenant = other_tenant
    policy_rule_save(rule)
    assert (current_policy_version(tenant.pk), current_policy_version(other_tenant.pk)) == (before[0] + 1,
                                                                                            before[1] + 1)


def test_names_are_unique_within_a_tenant_and_among_global_rules_only(seeded_policy, tenant, other_tenant):
    tenant_rule(tenant)
    tenant_rule(other_tenant)  # the same name in another tenant
    with pytest.raises(Exception) as refused:
        tenant_rule(tenant)
    assert refused.value.message_dict == {"name": ["a rule of this name exists already in this tenant"]}
    assert PolicyRule.objects.filter(name="deploys-need-a-human").count() == 2


def test_a_tenant_s_rule_change_voids_its_own_pending_requests_only(awaiting, tenant, other_tenant,  # noqa: F811
                                                                    approver):  # noqa: F811
    ours = pending_request(awaiting())
    theirs_run = awaiting()
    Run.objects.filter(pk=theirs_run.pk).update(tenant=other_tenant)
    ApprovalRequest.objects.filter(run=theirs_run).update(tenant=other_tenant)
    theirs = pending_request(theirs_run)
    other_approver = make_user("globex-approver", other_tenant, groups=("approvers",))

    tenant_rule(tenant, name="unrelated", pattern="nothing-matches-this")
    with pytest.raises(ConflictError) as voided:
        approval_decide(request=ours, actor=approver, approve=True, digest=ours.action_digest)
    assert "the policy changed" in voided.value.envelope["message"]
    assert ApprovalRequest.objects.get(pk=ours.pk).status == "voided"

    outcome = approval_decide(request=theirs, actor=other_approver, approve=True, digest=theirs.action_digest)
    assert outcome.request.status == "approved"


@pytest.fixture
def staff(tenant):
    """acme's staff, with every permission on rules: the scope alone stops them."""
    user = make_user("acme-staff", tenant)
    User.objects.filter(pk=user.pk).update(is_staff=True)
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="policy"))
    return User.objects.get(pk=user.pk)


def rule_form(**values) -> dict:
    return {"name": "acme-deploys", "tool": "shell", "field": "command", "pattern": r"\bdeploy\b", "negate": "",
            "outcome": "high", "reason": "deploys need a human", "enabled": "on", "priority": "50", **values}


def test_tenant_staff_edit_their_own_rules_in_the_admin_and_never_a_global_or_another_tenant_s(
        seeded_policy, client, staff, tenant, other_tenant):
    theirs = tenant_rule(other_tenant, name="globex-secret-rule")
    global_rule = PolicyRule.objects.filter(tenant__isnull=True).first()
    client.force_login(staff)
    before = current_policy_version(other_tenant.pk), current_policy_version()

    added = client.post(reverse("admin:policy_policyrule_add"), rule_form(tenant=str(other_tenant.pk)))
    assert added.status_code == 302, added.content[:2000]
    rule = PolicyRule.objects.get(name="acme-deploys")
    assert rule.tenant_id == tenant.pk  # lands in their tenant, whatever the form was sent
    assert (current_policy_version(other_tenant.pk), current_policy_version()) == before
    assert policy_dry_run(plan=PLAN, tenant=tenant).risk == "high"

    again = client.post(reverse("admin:policy_policyrule_add"), rule_form())
    assert again.status_code == 200 and again.context["adminform"].form.errors["name"] == [
        "a rule of this name exists already in this tenant"]

    listed = client.get(reverse("admin:policy_policyrule_changelist"))
    assert [row.pk for row in listed.context["cl"].queryset] == [rule.pk]
    assert "globex-secret-rule" not in listed.content.decode()
    for other in (theirs, global_rule):
        assert client.get(reverse("admin:policy_policyrule_change", args=[other.pk])).status_code == 404
        assert client.post(reverse("admin:policy_policyrule_change", args=[other.pk]),
                           rule_form(name=other.name)).status_code == 404
        assert client.post(reverse("admin:policy_policyrule_delete", args=[other.pk]),
                           {"post": "yes"}).status_code == 404
    assert PolicyRule.objects.filter(pk__in=[theirs.pk, global_rule.pk]).count() == 2
    assert client.get(reverse("admin:policy_policyversion_changelist")).status_code == 403


def test_the_superuser_makes_global_and_tenant_rules(seeded_policy, client, tenant, other_tenant):
    client.force_login(User.objects.create_superuser("operator", password="pw-operator"))
    start = current_policy_version(other_tenant.pk)
    assert client.post(reverse("admin:policy_policyrule_add"), rule_form(name="everyone", tenant="")
                       ).status_code == 302
    assert PolicyRule.objects.get(name="everyone").tenant_id is None
    assert current_policy_version(other_tenant.pk) == start + 1
    assert client.post(reverse("admin:policy_policyrule_add"), rule_form(name="acme-only", tenant=str(tenant.pk))
                       ).status_code == 302
    assert PolicyRule.objects.get(name="acme-only").tenant_id == tenant.pk
    assert current_policy_version(other_tenant.pk) == start + 1
