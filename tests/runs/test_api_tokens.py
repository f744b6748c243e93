"""API tokens (runs.tokens): only a digest is stored, the key works until it
expires or is revoked (at once), its use is recorded at most once a minute,
every creation and revocation is in the tenant's audit chain, and the admin
shows tenant staff their own tenant's tokens and never a key or a digest."""

from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from runs.audit_hash import CALLER_LANE
from runs.models import ApiToken, AuditEvent, AuditLog, Membership, Tenant
from runs.tokens import key_digest, token_create, token_revoke
from tests.conftest import make_token, make_user
from tests.runs.audit_rows import assert_unbroken, chain_of

pytestmark = pytest.mark.django_db


def client_with(key) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return client


def status_with(key) -> int:
    return client_with(key).get("/api/v1/runs").status_code


def rows_holding(text: str) -> list[str]:
    """Every table whose rows hold ``text`` anywhere, as the database returns them."""
    found = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names(cursor):
            cursor.execute(f"SELECT * FROM {connection.ops.quote_name(table)}")
            if any(text in repr(value) for row in cursor.fetchall() for value in row):
                found.append(table)
    return found


def test_the_key_is_in_no_database_row_and_its_digest_authenticates(agent):
    key = make_token(agent, name="ci runner")

    assert len(key) == 64 and rows_holding(key) == []
    token = ApiToken.objects.get(user=agent)
    assert (token.digest, token.key_prefix, token.name) == (key_digest(key), key[:8], "ci runner")
    assert status_with(key) == 200


@pytest.mark.parametrize("mangle", [
    lambda key: key[:-1] + ("0" if key[-1] != "0" else "1"),  # same prefix, another key
    lambda key: key[:40],  # the old scheme's length
    lambda key: key.upper(),
    lambda key: key + "0",
    lambda key: key_digest(key),  # the digest is no key
])
def test_a_wrong_key_is_refused(agent, mangle):
    key = make_token(agent)
    assert status_with(mangle(key)) == 401
    assert status_with(key) == 200


def test_an_expired_token_is_refused(agent):
    key = make_token(agent, expires_at=timezone.now() + timedelta(hours=1))
    assert status_with(key) == 200

    ApiToken.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    assert status_with(key) == 401


def test_a_revoked_token_is_refused_at_once(agent):
    key = make_token(agent)
    client = client_with(key)
    assert client.get("/api/v1/runs").status_code == 200

    assert token_revoke(token=ApiToken.objects.get(user=agent)) is True
    assert client.get("/api/v1/runs").status_code == 401
    assert token_revoke(token=ApiToken.objects.get(user=agent)) is False  # once only


def test_an_inactive_users_token_is_refused(agent):
    key = make_token(agent)
    User.objects.filter(pk=agent.pk).update(is_active=False)
    assert status_with(key) == 401


@pytest.mark.parametrize("key", ["a\x00b", "x" * 65, "abc-def", "zz zz", "é" * 10])
def test_an_implausible_key_is_refused_without_a_lookup(agent, key):
    make_token(agent)
    with CaptureQueriesContext(connection) as queries:
        response = client_with(key).get("/api/v1/runs")
    assert response.status_code == 401
    assert not [query for query in queries.captured_queries if ApiToken._meta.db_table in query["sql"]]


def test_last_use_is_recorded_at_most_once_a_minute(agent):
    key = make_token(agent)
    token = ApiToken.objects.get(user=agent)
    assert token.last_used_at is None

    before = timezone.now()
    assert status_with(key) == 200
    first = ApiToken.objects.get(pk=token.pk).last_used_at
    assert first is not None and first >= before

    thirty_s_ago = timezone.now() - timedelta(seconds=30)
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=thirty_s_ago)
    with CaptureQueriesContext(connection) as queries:
        assert status_with(key) == 200
    assert ApiToken.objects.get(pk=token.pk).last_used_at == thirty_s_ago
    assert not [q for q in queries.captured_queries if q["sql"].startswith("UPDATE") and "apitoken" in q["sql"]]

    ApiToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now() - timedelta(minutes=2))
    assert status_with(key) == 200
    assert ApiToken.objects.get(pk=token.pk).last_used_at > timezone.now() - timedelta(seconds=30)


def test_creation_and_revocation_are_audited_in_the_tenants_chain(tenant, agent):
    staff = make_user("acme_staff", tenant)
    token, key = token_create(user=agent, name="deploy bot", actor=staff, caller="test")
    token_revoke(token=token, actor=staff, caller="test")
    token_revoke(token=token, actor=staff, caller="test")  # already revoked: no second row

    rows = list(AuditLog.objects.filter(event__in=[AuditEvent.TOKEN_CREATED, AuditEvent.TOKEN_REVOKED])
                .order_by("chain_seq"))
    assert [(row.event, row.tenant_id, row.actor_id) for row in rows] == [
        (AuditEvent.TOKEN_CREATED, tenant.pk, staff.pk), (AuditEvent.TOKEN_REVOKED, tenant.pk, staff.pk)]
    assert rows[0].data == {"token_id": token.pk, "user": "agent", "name": "deploy bot",
                            "key_prefix": key[:8], "expires_at": None}
    assert_unbroken(chain_of(tenant.pk, CALLER_LANE), chain=tenant.pk)
    assert rows_holding(key) == []


def test_deleting_a_user_revokes_its_live_tokens_with_an_audit_row(tenant, agent):
    live, _ = token_create(user=agent, name="live")
    gone, _ = token_create(user=agent, name="already revoked")
    token_revoke(token=gone)

    agent.delete()

    revoked = AuditLog.objects.filter(event=AuditEvent.TOKEN_REVOKED).order_by("chain_seq")
    assert [(row.data["token_id"], row.tenant_id, row.caller) for row in revoked] == [
        (gone.pk, tenant.pk, ""), (live.pk, tenant.pk, "user deleted")]
    assert not ApiToken.objects.filter(pk__in=[live.pk, gone.pk]).exists()
    assert_unbroken(chain_of(tenant.pk, CALLER_LANE), chain=tenant.pk)


# --- the admin -------------------------------------------------------------------------


@pytest.fixture
def globex_token(other_tenant):
    """Another tenant's token, with a name that must not show."""
    user = make_user("globex_agent", other_tenant, groups=("agents",))
    return make_token(user, name="globex-secret-token")


@pytest.fixture
def staff(tenant):
    user = make_user("acme_staff", tenant)
    User.objects.filter(pk=user.pk).update(is_staff=True)
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="runs", codename__endswith="apitoken"))
    return User.objects.get(pk=user.pk)


@pytest.fixture
def staff_client(client, staff):
    client.force_login(staff)
    return client


def url(view: str, *args) -> str:
    return reverse(f"admin:runs_apitoken_{view}", args=args)


def test_staff_see_their_tenants_tokens_and_no_key_nor_digest(staff_client, agent, globex_token):
    key = make_token(agent, name="acme-agent-token")
    ours, theirs = ApiToken.objects.get(user=agent), ApiToken.objects.get(user__username="globex_agent")
    operator = User.objects.create_superuser("operator", password="pw-operator")
    Membership.objects.create(user=operator, tenant=Tenant.objects.get(name="acme"))
    operator_key = make_token(operator, name="operator-token")

    listing = staff_client.get(url("changelist"))
    assert listing.status_code == 200
    body = listing.content.decode()
    assert "acme-agent-token" in body and ours.key_prefix in body
    for secret in (key, ours.digest, globex_token, theirs.digest, "globex-secret-token", theirs.key_prefix,
                   "operator-token", operator_key):
        assert secret not in body

    page = staff_client.get(url("change", ours.pk))
    assert page.status_code == 200
    assert ours.key_prefix in page.content.decode()
    for secret in (key, ours.digest, key[8:]):
        assert secret not in page.content.decode()

    assert staff_client.get(url("change", theirs.pk)).status_code == 404
    assert staff_client.get(url("delete", ours.pk)).status_code == 403


def test_a_token_added_in_the_admin_shows_its_key_once(staff_client, tenant, agent):
    response = staff_client.post(url("add"), {"user": agent.pk, "name": "from the admin", "expires_at_0": "",
                                              "expires_at_1": ""})

    assert response.status_code == 200, response.content[-2000:]
    token = ApiToken.objects.get(user=agent)
    body = response.content.decode()
    key = body.split('id="new-token-key" value="', 1)[1].split('"', 1)[0]
    assert key_digest(key) == token.digest and "shown once" in body
    assert "no-store" in response["Cache-Control"]
    assert rows_holding(key) == []  # the session included: no message carries it
    assert key not in staff_client.get(url("changelist")).content.decode()
    assert key not in staff_client.get(url("change", token.pk)).content.decode()
    assert status_with(key) == 200
    audited = AuditLog.objects.get(event=AuditEvent.TOKEN_CREATED)
    assert (audited.tenant, audited.caller, audited.actor.username) == (tenant, "admin", "acme_staff")


def test_the_revoke_action_revokes_at_once_and_audits(staff_client, tenant, agent, globex_token):
    key = make_token(agent)
    ours, theirs = ApiToken.objects.get(user=agent), ApiToken.objects.get(user__username="globex_agent")

    response = staff_client.post(url("changelist"), {"action": "revoke_selected",
                                                     "_selected_action": [ours.pk, theirs.pk]})

    assert response.status_code == 302
    assert ApiToken.objects.get(pk=ours.pk).revoked_at is not None
    assert ApiToken.objects.get(pk=theirs.pk).revoked_at is None  # out of scope: untouched
    assert status_with(key) == 401 and status_with(globex_token) == 200
    revoked = AuditLog.objects.get(event=AuditEvent.TOKEN_REVOKED)
    assert (revoked.tenant, revoked.caller, revoked.data["token_id"]) == (tenant, "admin", ours.pk)
    assert_unbroken(chain_of(tenant.pk, CALLER_LANE), chain=tenant.pk)
    assert "revoked" in staff_client.get(url("changelist")).content.decode()
