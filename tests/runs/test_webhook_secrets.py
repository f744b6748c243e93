"""Each tenant signs its webhooks with a secret of its own (runs/webhooks.py,
Tenant.webhook_secret): a delivery verifies with its tenant's secret and no
other; a request replayed to another URL does not verify; a rotation in the
admin signs every later attempt (those of deliveries already queued
included); a tenant's staff see their own secret, never another tenant's;
the migration gave every existing tenant a secret of its own.

The receiver is a real HTTP server on loopback that keeps the raw requests."""

import importlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.apps import apps
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse

from runs.models import AuditLog, Tenant, WebhookDelivery
from runs.webhooks import verify, webhook_deliver
from tests.conftest import make_user

pytestmark = pytest.mark.django_db
MIGRATION = importlib.import_module("runs.migrations.0018_tenant_webhook_secret")


class Recorder:
    """Answers 200 to everything and keeps (path, headers, body) of each request."""

    def __init__(self):
        self.requests: list[tuple[str, dict, bytes]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                recorder.requests.append((self.path, dict(self.headers), body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.origin = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def recorder():
    recorder = Recorder()
    threading.Thread(target=recorder.server.serve_forever, daemon=True).start()
    yield recorder
    recorder.server.shutdown()


def deliver(tenant: Tenant, url: str, **payload) -> tuple[dict, bytes]:
    delivery = WebhookDelivery.objects.create(event="thing.happened", url=url, payload=payload, tenant=tenant)
    assert webhook_deliver(delivery.pk) is True
    return delivery


def test_every_tenant_has_its_own_secret(tenant, other_tenant):
    secrets = {tenant.webhook_secret, other_tenant.webhook_secret, Tenant.objects.create(name="third").webhook_secret}
    assert len(secrets) == 3 and all(len(secret) >= 40 for secret in secrets)


def test_the_migration_gives_each_existing_tenant_a_secret_of_its_own(tenant, other_tenant):
    Tenant.objects.update(webhook_secret="")  # as the column's first step leaves them
    MIGRATION.give_each_tenant_a_secret(apps, None)
    secrets = list(Tenant.objects.values_list("webhook_secret", flat=True))
    assert len(secrets) == 2 and all(secrets) and len(set(secrets)) == 2


def test_a_delivery_verifies_with_its_tenants_secret_only(recorder, tenant, other_tenant):
    url = recorder.origin + "/hooks"
    deliver(tenant, url, n=1)
    deliver(other_tenant, url, n=2)
    (path_a, headers_a, body_a), (path_b, headers_b, body_b) = recorder.requests
    assert path_a == path_b == "/hooks"
    assert json.loads(body_a)["data"] == {"n": 1} and json.loads(body_b)["data"] == {"n": 2}
    assert verify(tenant.webhook_secret, headers_a, body_a, url=url)
    assert not verify(other_tenant.webhook_secret, headers_a, body_a, url=url)
    assert verify(other_tenant.webhook_secret, headers_b, body_b, url=url)
    assert not verify(tenant.webhook_secret, headers_b, body_b, url=url)


def test_a_signature_replayed_to_another_url_fails(recorder, tenant):
    first, second = recorder.origin + "/first", recorder.origin + "/second"
    deliver(tenant, first, n=1)
    [(_, headers, body)] = recorder.requests
    assert verify(tenant.webhook_secret, headers, body, url=first)
    assert not verify(tenant.webhook_secret, headers, body, url=second)
    assert not verify(tenant.webhook_secret, headers, body, url=first.replace("127.0.0.1", "localhost"))


def staff_of(tenant: Tenant, username: str) -> Client:
    staff = make_user(username, tenant)
    staff.is_staff = True
    staff.save(update_fields=["is_staff"])
    staff.user_permissions.add(*Permission.objects.filter(codename__in=["view_tenant", "change_tenant"]))
    client = Client()
    client.force_login(staff)
    return client


def test_a_rotation_in_the_admin_signs_every_later_attempt(recorder, tenant):
    url = recorder.origin + "/hooks"
    old = tenant.webhook_secret
    queued = WebhookDelivery.objects.create(event="thing.happened", url=url, payload={"n": "queued"}, tenant=tenant)
    deliver(tenant, url, n="before")

    client = staff_of(tenant, "ops")
    response = client.post(reverse("admin:runs_tenant_changelist"), {
        "action": "rotate_webhook_secret", "_selected_action": [str(tenant.pk)]})
    assert response.status_code == 302
    tenant.refresh_from_db()
    new = tenant.webhook_secret
    assert new and new != old

    deliver(tenant, url, n="after")
    assert webhook_deliver(queued.pk) is True  # queued before the rotation, sent after it
    bodies = {json.loads(body)["data"]["n"]: (headers, body) for _, headers, body in recorder.requests}
    assert verify(old, *bodies["before"], url=url) and not verify(new, *bodies["before"], url=url)
    for late in ("after", "queued"):
        assert verify(new, *bodies[late], url=url) and not verify(old, *bodies[late], url=url)

    [row] = AuditLog.objects.filter(event="admin_changed", tenant=tenant)
    assert row.data["changed_fields"] == ["webhook_secret"] and row.caller == "admin"
    assert old not in json.dumps(row.data) and new not in json.dumps(row.data)


def test_staff_see_their_tenants_secret_and_never_another_tenants(tenant, other_tenant):
    mine, theirs = staff_of(tenant, "ops_a"), staff_of(other_tenant, "ops_b")
    page = mine.get(reverse("admin:runs_tenant_change", args=[tenant.pk]))
    assert page.status_code == 200 and tenant.webhook_secret.encode() in page.content
    assert mine.get(reverse("admin:runs_tenant_change", args=[other_tenant.pk])).status_code == 404
    listing = mine.get(reverse("admin:runs_tenant_changelist"))
    assert tenant.webhook_secret.encode() not in listing.content  # not in the list, only on the page
    assert other_tenant.webhook_secret.encode() not in listing.content

    # B can neither read A's secret nor rotate it by naming A's id.
    theirs.post(reverse("admin:runs_tenant_changelist"), {"action": "rotate_webhook_secret",
                                                           "_selected_action": [str(tenant.pk)]})
    before = tenant.webhook_secret
    tenant.refresh_from_db()
    assert tenant.webhook_secret == before
    assert tenant.webhook_secret.encode() not in theirs.get(
        reverse("admin:runs_tenant_change", args=[other_tenant.pk])).content

    # Renaming the tenant is audited without its secret; the secret is no form input.
    renamed = mine.post(reverse("admin:runs_tenant_change", args=[tenant.pk]),
                        {"name": "acme renamed", "webhook_secret": "chosen-by-attacker",
                         "standing_grant_max_hours": str(tenant.standing_grant_max_hours),
                         "approval_reminder_fractions": "[0.5, 0.9]", "approval_escalation_after_s": "0",
                         "approval_escalation_group": "escalation"})
    assert renamed.status_code == 302
    tenant.refresh_from_db()
    assert (tenant.name, tenant.webhook_secret) == ("acme renamed", before)
    [row] = AuditLog.objects.filter(event="admin_changed", tenant=tenant)
    assert row.data["changed_fields"] == ["name"] and before not in json.dumps(row.data)


def test_a_deployment_still_setting_the_shared_secret_is_warned(monkeypatch):
    from django.core import checks

    monkeypatch.setenv("EXECGO_WEBHOOK_SECRET", "from-an-earlier-release")
    assert [message.id for message in checks.run_checks(tags=[checks.Tags.security])
            if message.id.startswith("execgo.")] == ["execgo.W001"]
    monkeypatch.delenv("EXECGO_WEBHOOK_SECRET")
    assert not [message for message in checks.run_checks(tags=[checks.Tags.security])
                if message.id.startswith("execgo.")]
