"""execgo_bootstrap: the demo tenant, its three users and the agent's token,
created once and left alone on every later run."""

import logging
from io import StringIO

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from runs.models import ApiToken, AuditEvent, AuditLog, Membership, Tenant
from runs.tokens import key_digest, token_revoke

pytestmark = pytest.mark.django_db

PASSWORD_ENV = ("EXECGO_ADMIN_PASSWORD", "EXECGO_APPROVER_PASSWORD")


@pytest.fixture(autouse=True)
def no_password_env(monkeypatch):
    for name in PASSWORD_ENV:
        monkeypatch.delenv(name, raising=False)


def bootstrap(*args, **options) -> dict[str, str]:
    """Run the command; return its ``KEY=value`` lines and, under "", the whole output."""
    out = StringIO()
    call_command("execgo_bootstrap", *args, stdout=out, **options)
    text = out.getvalue()
    values = dict(line.split("=", 1) for line in text.splitlines() if "=" in line and " " not in line)
    values[""] = text
    return values


def counts() -> dict[str, int]:
    return {model.__name__: model.objects.count() for model in (User, Group, Tenant, Membership, ApiToken)}


def test_creates_tenant_users_groups_memberships_and_token():
    printed = bootstrap()

    demo = Tenant.objects.get(name="demo")
    admin = User.objects.get(username="admin")
    approver = User.objects.get(username="approver")
    agent = User.objects.get(username="agent")
    assert (admin.is_superuser, admin.is_staff) == (True, True)
    assert (approver.is_superuser, agent.is_superuser) == (False, False)
    assert list(approver.groups.values_list("name", flat=True)) == ["approvers"]
    assert list(agent.groups.values_list("name", flat=True)) == ["agents"]
    assert {m.user.username: m.tenant for m in Membership.objects.select_related("user", "tenant")} == {
        "admin": demo, "approver": demo, "agent": demo,
    }
    assert ApiToken.objects.get(user=agent).digest == key_digest(printed["EXECGO_AGENT_TOKEN"])
    assert len(printed["EXECGO_AGENT_TOKEN"]) == 64
    created = AuditLog.objects.get(event=AuditEvent.TOKEN_CREATED)
    assert (created.tenant, created.caller, created.data["user"]) == (demo, "execgo_bootstrap", "agent")
    assert f"\nEXECGO_AGENT_TOKEN={printed['EXECGO_AGENT_TOKEN']}\n" in printed[""]

    # The generated passwords are printed and are the real ones.
    assert admin.check_password(printed["EXECGO_ADMIN_PASSWORD"])
    assert approver.check_password(printed["EXECGO_APPROVER_PASSWORD"])
    assert printed["EXECGO_ADMIN_PASSWORD"] != printed["EXECGO_APPROVER_PASSWORD"]
    assert not agent.has_usable_password()
    assert "EXECGO_AGENT_PASSWORD" not in printed


def test_second_run_changes_nothing_and_prints_no_key():
    first = bootstrap()
    before = counts()
    hashes = dict(User.objects.values_list("username", "password"))

    second = bootstrap()

    assert counts() == before == {"User": 3, "Group": 2, "Tenant": 1, "Membership": 3, "ApiToken": 1}
    # Only the digest is kept: the key was shown once, by the first run.
    assert "EXECGO_AGENT_TOKEN" in first and "EXECGO_AGENT_TOKEN" not in second
    assert first["EXECGO_AGENT_TOKEN"] not in second[""]
    assert "agent token: exists" in second[""]
    assert dict(User.objects.values_list("username", "password")) == hashes
    assert "EXECGO_ADMIN_PASSWORD" not in second
    assert "EXECGO_APPROVER_PASSWORD" not in second
    assert "admin: existing password kept" in second[""]
    assert "approver: existing password kept" in second[""]


def test_a_revoked_agent_token_is_replaced_by_the_next_run():
    first = bootstrap()["EXECGO_AGENT_TOKEN"]
    token_revoke(token=ApiToken.objects.get(digest=key_digest(first)))

    second = bootstrap()["EXECGO_AGENT_TOKEN"]

    assert second != first
    assert ApiToken.objects.filter(user__username="agent", revoked_at__isnull=True).get().digest == key_digest(second)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {first}")
    assert client.get("/api/v1/runs").status_code == 401
    client.credentials(HTTP_AUTHORIZATION=f"Token {second}")
    assert client.get("/api/v1/runs").status_code == 200


def test_printed_token_authenticates_the_api():
    token = bootstrap()["EXECGO_AGENT_TOKEN"]

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    assert client.get("/api/v1/runs").status_code == 200

    client.credentials(HTTP_AUTHORIZATION="Token " + "0" * 40)
    assert client.get("/api/v1/runs").status_code == 401


def test_passwords_from_options_and_environment_are_set_and_not_echoed(monkeypatch, client):
    monkeypatch.setenv("EXECGO_APPROVER_PASSWORD", "approver-from-env")

    printed = bootstrap("--admin-password", "admin-from-option")

    assert User.objects.get(username="admin").check_password("admin-from-option")
    assert User.objects.get(username="approver").check_password("approver-from-env")
    assert "admin-from-option" not in printed[""]
    assert "approver-from-env" not in printed[""]
    assert "EXECGO_ADMIN_PASSWORD" not in printed
    assert client.login(username="admin", password="admin-from-option")

    # The same password again is a no-op; a different one replaces it.
    hash_before = User.objects.get(username="admin").password
    again = bootstrap(admin_password="admin-from-option")
    assert User.objects.get(username="admin").password == hash_before
    assert "admin: existing password kept (matches the one given)" in again[""]
    bootstrap(admin_password="admin-rotated")
    assert User.objects.get(username="admin").check_password("admin-rotated")


def test_a_rejected_password_leaves_nothing_behind():
    with pytest.raises(CommandError, match="too short"):
        bootstrap(approver_password="short")

    assert counts() == {"User": 0, "Group": 0, "Tenant": 0, "Membership": 0, "ApiToken": 0}


def test_refuses_to_move_a_user_from_another_tenant():
    elsewhere = Tenant.objects.create(name="elsewhere")
    approver = User.objects.create_user("approver", password="kept-password")
    Membership.objects.create(user=approver, tenant=elsewhere)

    with pytest.raises(CommandError, match="belongs to tenant 'elsewhere'"):
        bootstrap()

    assert Membership.objects.get(user=approver).tenant == elsewhere
    assert not Tenant.objects.filter(name="demo").exists()


def test_secrets_never_reach_the_logging_module(caplog):
    caplog.set_level(logging.DEBUG)

    printed = bootstrap()

    for secret in (printed["EXECGO_AGENT_TOKEN"], printed["EXECGO_ADMIN_PASSWORD"],
                   printed["EXECGO_APPROVER_PASSWORD"]):
        assert secret not in caplog.text
