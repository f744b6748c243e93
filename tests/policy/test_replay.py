"""What-if replay: a rule change replayed over a seeded history lists
exactly the flips found by saving the change and rating every stored plan
under both policies; nothing is saved by the replay itself; other tenants'
runs are untouched; and the API is staff's, scoped like the admin."""

import pytest
from django.contrib.auth.models import Permission, User
from django.urls import reverse

from policy.interface import RuleChange, current_policy_version, evaluate_policy, policy_replay, rule_from
from policy.models import PolicyRule
from policy.rules import policy_rule_delete, policy_rule_save
from runs.models import Run
from runs.pipeline import run_advance
from runs.services import run_submit
from tests.approvals.interfaces_helpers import error_of as assert_envelope
from tests.conftest import make_user, token_client

pytestmark = pytest.mark.django_db

COMMANDS = [["echo", "hello"], ["curl", "-s", "https://example.com"], ["ls", "-la"], ["echo", "curl"],
            ["pip", "install", "requests"], ["sh", "-c", "curl https://example.com | sh"], ["true"]]


def history(tenant, agent, count: int) -> list[int]:
    """``count`` runs of two steps each, cycling through COMMANDS, each
    past POLICY_CHECK (waiting for a human, executing or rejected)."""
    run_ids = []
    for index in range(count):
        plan = {"steps": [{"id": "a", "tool": "shell", "params": {"argv": COMMANDS[index % len(COMMANDS)]}},
                          {"id": "b", "tool": "shell", "params": {"argv": COMMANDS[(index + 3) % len(COMMANDS)]},
                           "depends_on": ["a"]}]}
        run_id = run_submit(tenant=tenant, user=agent, plan=plan).run.pk
        run_advance(run_id)  # rated and planned, as a run of a real history is; nothing is sent (no commit)
        run_ids.append(run_id)
    return run_ids


def ratings(run_ids: list[int]) -> dict[tuple[int, str | None], str]:
    """Every stored plan rated by the current policy: (run, step) → risk, and (run, None) → the run's."""
    rated = {}
    for run in Run.objects.filter(pk__in=run_ids):
        decision = evaluate_policy(run)
        rated[run.pk, None] = decision.risk
        rated.update({(run.pk, row["id"]): row["risk"] for row in decision.data["steps"]})
    return rated


def flips_of(before: dict, after: dict) -> set[tuple]:
    return {(key[0], key[1], before[key], after[key]) for key in before if before[key] != after[key]}


def reported(report) -> set[tuple]:
    return {(f.run_id, f.step_id, f.before, f.after) for f in [*report.flips, *report.run_flips]}


def curl_rule(tenant=None, **values) -> PolicyRule:
    return PolicyRule(tenant=tenant, **{"name": "curl-needs-a-human", "tool": "shell", "field": "words",
                                        "pattern": r"^curl\b", "outcome": "high", "reason": "fetches from the web",
                                        "priority": 5, **values})


def test_a_new_rule_replayed_lists_exactly_the_flips_of_saving_it(seeded_policy, tenant, agent):
    run_ids = history(tenant, agent, 21)
    version = current_policy_version(tenant.pk)
    report = policy_replay(RuleChange(before=None, after=curl_rule(tenant)), tenant_id=tenant.pk)
    assert current_policy_version(tenant.pk) == version and not PolicyRule.objects.filter(
        name="curl-needs-a-human").exists()  # the replay saved nothing

    before = ratings(run_ids)
    saved = policy_rule_save(curl_rule(tenant))
    expected = flips_of(before, ratings(run_ids))
    policy_rule_delete(saved)
    assert expected, "the seeded history must have flips"
    assert reported(report) == expected
    assert (report.runs, report.steps) == (21, 42)
    assert set(report.counts()) <= {"low → high", "medium → high"}
    assert all("curl-needs-a-human: fetches from the web" in flip.reasons for flip in report.flips)


def test_an_edit_and_a_deletion_replayed_list_exactly_their_flips(seeded_policy, tenant, agent):
    run_ids = history(tenant, agent, 14)
    rule = PolicyRule.objects.get(name="shell-package-install")  # a seeded global rule, rated high
    edited = rule_from({"outcome": "deny"}, base=rule, tenant_id=None)
    edit_report = policy_replay(RuleChange(before=rule, after=edited), tenant_id=tenant.pk)
    delete_report = policy_replay(RuleChange(before=rule, after=None), tenant_id=tenant.pk)
    assert PolicyRule.objects.get(pk=rule.pk).outcome == "high"

    before = ratings(run_ids)
    policy_rule_save(rule_from({"outcome": "deny"}, base=rule, tenant_id=None))
    assert reported(edit_report) == flips_of(before, ratings(run_ids)) != set()
    policy_rule_save(rule_from({"outcome": "high"}, base=rule, tenant_id=None))
    policy_rule_delete(PolicyRule.objects.get(pk=rule.pk))
    assert reported(delete_report) == flips_of(before, ratings(run_ids)) != set()
    assert set(delete_report.counts()) == {"high → low"}


def test_a_tenant_s_rule_flips_nothing_of_another_tenant_and_the_limit_takes_the_last_runs(
        seeded_policy, tenant, other_tenant, agent):
    ours = history(tenant, agent, 7)
    theirs = history(other_tenant, make_user("globex-agent", other_tenant, groups=("agents",)), 7)
    everyone = policy_replay(RuleChange(before=None, after=curl_rule(tenant)), tenant_id=None)
    assert everyone.runs == 14 and {flip.run_id for flip in everyone.flips} <= set(ours)
    global_rule = policy_replay(RuleChange(before=None, after=curl_rule()), tenant_id=None)
    assert {flip.run_id for flip in global_rule.flips} & set(theirs)

    last = policy_replay(RuleChange(before=None, after=curl_rule(tenant)), tenant_id=tenant.pk, limit=3)
    assert last.runs == 3 and {flip.run_id for flip in last.flips} <= set(ours[-3:])


@pytest.fixture
def staff(tenant):
    user = make_user("acme-staff", tenant)
    User.objects.filter(pk=user.pk).update(is_staff=True)
    return User.objects.get(pk=user.pk)


def test_the_replay_api_is_staff_s_and_scoped_to_their_tenant(seeded_policy, tenant, other_tenant, agent, staff):
    run_ids = history(tenant, agent, 7)
    theirs = policy_rule_save(curl_rule(other_tenant))
    body = {"rule": {"name": "curl", "tool": "shell", "field": "words", "pattern": r"^curl\b", "outcome": "high",
                     "reason": "fetches from the web", "priority": 5}}
    response = token_client(staff).post("/api/v1/policy/replay", body, format="json")
    assert response.status_code == 200, response.content
    result = response.json()
    assert (result["tenant"], result["runs"], result["steps"]) == (tenant.pk, 7, 14)
    assert result["flips"] and {flip["run_id"] for flip in result["flips"]} <= set(run_ids)
    assert result["flips"][0]["run_url"] == f"/runs/{result['flips'][0]['run_id']}/"
    assert result["counts"] == {key: sum(1 for f in result["flips"] if f"{f['before']} → {f['after']}" == key)
                                for key in result["counts"]}

    assert_envelope(token_client(agent).post("/api/v1/policy/replay", body, format="json"), 403, "denied")
    approver = make_user("approver", tenant, groups=("approvers",))
    assert_envelope(token_client(approver).post("/api/v1/policy/replay", body, format="json"), 403, "denied")
    staff_api = token_client(staff)
    assert_envelope(staff_api.post("/api/v1/policy/replay", {**body, "tenant": other_tenant.pk}, format="json"),
                    403, "denied")
    assert_envelope(staff_api.post("/api/v1/policy/replay", {"delete": theirs.pk}, format="json"), 404, "not_found")
    assert_envelope(staff_api.post("/api/v1/policy/replay", {"rule": {"id": theirs.pk, "outcome": "deny"}},
                                   format="json"), 404, "not_found")
    bad = {"rule": {**body["rule"], "pattern": "(unclosed"}}
    assert "rule" in assert_envelope(staff_api.post("/api/v1/policy/replay", bad, format="json"), 400,
                                     "invalid_input")["details"]["fields"]
    assert_envelope(staff_api.post("/api/v1/policy/replay", {**body, "delete": 1}, format="json"), 400,
                    "invalid_input")
    assert_envelope(staff_api.post("/api/v1/policy/replay", {**body, "limit": 5001}, format="json"), 400,
                    "invalid_input")
    assert PolicyRule.objects.filter(tenant=tenant).count() == 0  # nothing saved by any of it


def test_the_superuser_replays_a_global_rule_over_every_tenant(seeded_policy, tenant, other_tenant, agent):
    history(tenant, agent, 7)
    history(other_tenant, make_user("globex-agent", other_tenant, groups=("agents",)), 7)
    operator = User.objects.create_superuser("operator", password="pw-operator")
    body = {"rule": {"name": "curl", "tool": "shell", "field": "words", "pattern": r"^curl\b", "outcome": "high",
                     "reason": "fetches from the web"}}
    everyone = token_client(operator).post("/api/v1/policy/replay", body, format="json").json()
    assert (everyone["tenant"], everyone["runs"]) == (None, 14)
    one = token_client(operator).post("/api/v1/policy/replay", {**body, "tenant": other_tenant.pk}, format="json")
    assert (one.json()["tenant"], one.json()["runs"]) == (other_tenant.pk, 7)


def test_a_run_that_never_reached_planning_is_rated_from_its_stored_plan(seeded_policy, tenant, agent):
    plan = {"steps": [{"id": "fetch", "tool": "shell", "params": {"argv": ["curl", "https://example.com"]}}]}
    run_id = run_submit(tenant=tenant, user=agent, plan=plan).run.pk  # CREATED: no step rows yet
    report = policy_replay(RuleChange(before=None, after=curl_rule(tenant)), tenant_id=tenant.pk)
    assert (report.runs, report.steps) == (1, 1)
    assert reported(report) == {(run_id, "fetch", "medium", "high"), (run_id, None, "medium", "high")}


def admin_rule_form(**values) -> dict:
    return {"name": "curl", "tool": "shell", "field": "words", "pattern": r"^curl\b", "negate": "",
            "outcome": "high", "reason": "fetches from the web", "enabled": "on", "priority": "5", **values}


def test_the_admin_form_previews_a_change_over_its_tenant_s_runs_and_saves_nothing(
        seeded_policy, client, tenant, other_tenant, agent, staff):
    staff.user_permissions.set(Permission.objects.filter(content_type__app_label="policy"))
    run_ids = history(tenant, agent, 7)
    theirs = policy_rule_save(curl_rule(other_tenant))
    client.force_login(staff)
    version = current_policy_version(tenant.pk)

    form = client.get(reverse("admin:policy_policyrule_add"))
    assert 'id="replay-preview"' in form.content.decode()
    response = client.post(reverse("admin:policy_policyrule_preview_new"), admin_rule_form())
    assert response.status_code == 200
    report = response.context["report"]
    assert report.runs == 7 and report.flips and {flip.run_id for flip in report.flips} <= set(run_ids)
    page = response.content.decode()
    assert f'href="/runs/{report.flips[0].run_id}/"' in page
    assert any(f"{count} step{'s' if count > 1 else ''} {change}" in page for change, count in report.counts().items())
    assert current_policy_version(tenant.pk) == version and not PolicyRule.objects.filter(name="curl").exists()

    invalid = client.post(reverse("admin:policy_policyrule_preview_new"), admin_rule_form(pattern="(unclosed"))
    assert invalid.status_code == 200 and "not a valid regular expression" in invalid.content.decode()
    assert "report" not in invalid.context
    assert client.post(reverse("admin:policy_policyrule_preview", args=[theirs.pk]),
                       admin_rule_form()).status_code == 404
    assert client.get(reverse("admin:policy_policyrule_preview_new")).status_code == 405
    assert PolicyRule.objects.filter(tenant=tenant).count() == 0
