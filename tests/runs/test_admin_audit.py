"""Admin changes are in the audit chain (runs/admin_audit.py): a policy rule
edited, added, deleted (its page, its list's inline edit, the delete action);
a user's fields, groups and password; a group; a membership; each row with
the acting user, the object's before/after as stored, on the right tenant's
chain, no secret in it; and the export of the chain verifies offline."""

import json

import pytest
from django.contrib.auth.models import Group, Permission, User
from django.test import Client
from django.urls import reverse

from policy.models import PolicyRule
from runs.invariants import audit_chain_breaks
from runs.models import AuditEvent, AuditLog, Membership
from tests.conftest import make_user
from tests.runs.audit_rows import manage, transactional, verify_offline


@pytest.fixture
def operator(db):
    return User.objects.create_superuser("operator", password="pw-operator")


@pytest.fixture
def operator_client(operator):
    client = Client()
    client.force_login(operator)
    return client


def admin_rows(**filters) -> list[AuditLog]:
    return list(AuditLog.objects.filter(event=AuditEvent.ADMIN_CHANGED, **filters).order_by("chain_lane", "chain_seq"))


RULE_FORM = {"name": "no-curl", "tool": "shell", "field": "argv", "pattern": r"\bcurl\b", "outcome": "high",
             "reason": "fetches from the network", "enabled": "on", "priority": "5"}


def test_a_rule_added_changed_and_deleted_in_the_admin_is_audited(operator_client, operator):
    added = operator_client.post(reverse("admin:policy_policyrule_add"), RULE_FORM)
    assert added.status_code == 302, added.content
    rule = PolicyRule.objects.get(name="no-curl")

    changed = operator_client.post(reverse("admin:policy_policyrule_change", args=[rule.pk]),
                                   {**RULE_FORM, "outcome": "deny", "priority": "3"})
    assert changed.status_code == 302
    unchanged = operator_client.post(reverse("admin:policy_policyrule_change", args=[rule.pk]),
                                     {**RULE_FORM, "outcome": "deny", "priority": "3"})
    assert unchanged.status_code == 302  # saved again with nothing changed: no row
    deleted = operator_client.post(reverse("admin:policy_policyrule_delete", args=[rule.pk]), {"post": "yes"})
    assert deleted.status_code == 302 and not PolicyRule.objects.filter(pk=rule.pk).exists()

    rows = admin_rows(tenant__isnull=True)
    assert [row.data["action"] for row in rows] == ["added", "changed", "deleted"]
    assert all(row.actor_id == operator.pk and row.caller == "admin" and row.run_id is None for row in rows)
    assert all(row.data["model"] == "policy.policyrule" and row.data["object_id"] == str(rule.pk) for row in rows)
    add, change, delete = (row.data for row in rows)
    assert add["before"] is None and add["after"]["pattern"] == r"\bcurl\b" and add["after"]["outcome"] == "high"
    assert change["changed_fields"] == ["outcome", "priority"]
    assert (change["before"]["outcome"], change["after"]["outcome"]) == ("high", "deny")
    assert (change["before"]["priority"], change["after"]["priority"]) == (5, 3)
    assert change["before"]["pattern"] == change["after"]["pattern"] == r"\bcurl\b"
    assert delete["after"] is None and delete["before"]["outcome"] == "deny"
    assert audit_chain_breaks() == []


def test_the_lists_inline_edit_and_the_delete_action_are_audited(operator_client):
    rules = [PolicyRule.objects.create(name=f"r{number}", tool="shell", field="argv", pattern=f"x{number}",
                                       outcome="high", reason="test", priority=number) for number in range(2)]
    listing = {"form-TOTAL_FORMS": "2", "form-INITIAL_FORMS": "2", "_save": "Save"}
    for index, rule in enumerate(rules):
        listing.update({f"form-{index}-id": str(rule.pk), f"form-{index}-priority": str(rule.priority),
                        f"form-{index}-enabled": "on"})
    listing["form-1-priority"] = "40"
    assert operator_client.post(reverse("admin:policy_policyrule_changelist"), listing).status_code == 302
    [edit] = admin_rows()
    assert edit.data["object_id"] == str(rules[1].pk) and edit.data["changed_fields"] == ["priority"]

    action = operator_client.post(reverse("admin:policy_policyrule_changelist"), {
        "action": "delete_selected", "_selected_action": [str(rule.pk) for rule in rules], "post": "yes"})
    assert action.status_code == 302 and not PolicyRule.objects.filter(pk__in=[rule.pk for rule in rules]).exists()
    assert sorted(row.data["object_id"] for row in admin_rows() if row.data["action"] == "deleted") == sorted(
        str(rule.pk) for rule in rules)


def test_user_changes_go_on_the_users_tenant_chain_without_the_password(operator_client, operator, tenant,
                                                                         other_tenant):
    ann = make_user("ann", tenant)
    approvers = Group.objects.create(name="approvers")
    old_hash = ann.password
    form = {"username": "ann", "first_name": "Ann", "last_name": "", "email": "ann@example.com",
            "is_active": "on", "is_staff": "on", "groups": [str(approvers.pk)],
            "date_joined_0": ann.date_joined.strftime("%Y-%m-%d"), "date_joined_1": ann.date_joined.strftime("%H:%M:%S"),
            "initial-date_joined_0": ann.date_joined.strftime("%Y-%m-%d"),
            "initial-date_joined_1": ann.date_joined.strftime("%H:%M:%S")}
    response = operator_client.post(reverse("admin:auth_user_change", args=[ann.pk]), form)
    assert response.status_code == 302, response.content.decode()[:2000]
    password = operator_client.post(reverse("admin:auth_user_password_change", args=[ann.pk]),
                                    {"password1": "a-new-long-password", "password2": "a-new-long-password",
                                     "set_usable_password": "true"})
    assert password.status_code == 302
    ann.refresh_from_db()
    assert ann.password != old_hash

    rows = admin_rows(tenant=tenant)
    assert [row.data["action"] for row in rows] == ["changed", "changed"]
    fields, secret = rows[0].data, rows[1].data
    # (date_joined too: the admin's date and time inputs drop its microseconds, and the row says so.)
    assert set(fields["changed_fields"]) - {"date_joined"} == {"first_name", "email", "is_staff", "groups"}
    assert (fields["before"]["groups"], fields["after"]["groups"]) == ([], ["approvers"])
    assert fields["before"]["is_staff"] is False and fields["after"]["is_staff"] is True
    assert secret["changed_fields"] == ["password"] and secret["after"]["password"] == "password changed"
    text = json.dumps([row.data for row in AuditLog.objects.all()])
    assert old_hash not in text and ann.password not in text and "pbkdf2" not in text and "md5$" not in text
    assert not admin_rows(tenant=other_tenant)

    # A membership moved to another tenant: a row on both chains.
    membership = Membership.objects.get(user=ann)
    moved = operator_client.post(reverse("admin:runs_membership_change", args=[membership.pk]),
                                 {"user": str(ann.pk), "tenant": str(other_tenant.pk)})
    assert moved.status_code == 302
    [there] = admin_rows(tenant=other_tenant)
    assert there.data["model"] == "runs.membership"
    assert (there.data["before"]["tenant"], there.data["after"]["tenant"]) == (tenant.pk, other_tenant.pk)
    assert admin_rows(tenant=tenant)[-1].data == there.data


def test_a_group_and_its_permissions_are_audited_on_the_no_tenant_chain(operator_client, operator):
    permission = Permission.objects.get(codename="view_run")
    response = operator_client.post(reverse("admin:auth_group_add"), {"name": "auditors",
                                                                       "permissions": [str(permission.pk)]})
    assert response.status_code == 302
    [row] = admin_rows(tenant__isnull=True)
    assert row.data["model"] == "auth.group" and row.data["after"]["name"] == "auditors"
    assert row.data["after"]["permissions"] == [str(permission)]


def test_tenant_staff_adding_a_user_is_audited_in_their_tenant(tenant):
    staff = make_user("ops", tenant)
    staff.is_staff = True
    staff.save()
    staff.user_permissions.add(*Permission.objects.filter(codename__in=["add_user", "change_user", "view_user"]))
    client = Client()
    client.force_login(staff)
    response = client.post(reverse("admin:auth_user_add"), {
        "username": "newbie", "password1": "a-long-password-1", "password2": "a-long-password-1",
        "usable_password": "true"})
    assert response.status_code == 302, response.content.decode()[:2000]
    rows = admin_rows(tenant=tenant)
    added = [row for row in rows if row.data["model"] == "auth.user" and row.data["action"] == "added"]
    assert len(added) == 1 and added[0].actor_id == staff.pk
    assert added[0].data["after"]["username"] == "newbie" and added[0].data["after"]["tenant"] == tenant.pk
    assert added[0].data["after"]["password"] == "password changed"
    assert User.objects.get(username="newbie").password not in json.dumps(added[0].data)


@transactional
def test_the_no_tenant_export_verifies_and_holds_the_rule_edit(tmp_path):
    operator = User.objects.create_superuser("operator", password="pw-operator")
    client = Client()
    client.force_login(operator)
    assert client.post(reverse("admin:policy_policyrule_add"), RULE_FORM).status_code == 302
    rule = PolicyRule.objects.get(name="no-curl")
    assert client.post(reverse("admin:policy_policyrule_change", args=[rule.pk]),
                       {**RULE_FORM, "pattern": r"\b(curl|wget)\b"}).status_code == 302

    export = tmp_path / "installation.jsonl"
    done = manage("execgo_audit_export", "--no-tenant", "--output", str(export))
    assert done.returncode == 0, done.stderr
    assert "audit rows of no tenant" in done.stderr
    lines = [json.loads(line) for line in export.read_text().splitlines()]
    [edit] = [line for line in lines if line["event"] == "admin_changed" and line["data"]["action"] == "changed"]
    assert edit["actor"] == operator.pk and edit["tenant"] is None
    assert (edit["data"]["before"]["pattern"], edit["data"]["after"]["pattern"]) == (r"\bcurl\b", r"\b(curl|wget)\b")
    ok = verify_offline(export)
    assert ok.returncode == 0 and ok.stdout.startswith(f"OK: {len(lines)} rows"), ok.stdout + ok.stderr

    edited = export.read_text().replace(r"\\b(curl|wget)\\b", r"\\bwget\\b")
    assert edited != export.read_text()
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text(edited)
    assert verify_offline(tampered).returncode == 1
