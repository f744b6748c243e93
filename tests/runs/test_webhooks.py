"""Outgoing webhooks (runs/webhooks.py): the row written in the caller's
transaction, one attempt at a time against a local receiver (the delay
between attempts, the admin's read-only list of deliveries), and, on a real
worker, the approval notifications delivered despite a flaky receiver — or
given up on, without touching the run, when the receiver is down. The
signature and its check: test_webhook_signatures.py."""

import json
import threading
import time
from collections import Counter
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.db import transaction
from django.urls import reverse

from approvals.models import APPROVERS_GROUP, ApprovalRequest
from approvals.services import approval_decide, approval_expire
from policy.models import PolicyRule
from policy.rules import policy_rule_save
from runs.errors import ConflictError
from runs.models import AuditLog, Run, WebhookDelivery, WebhookStatus
from runs.pipeline import run_advance
from runs.services import run_submit
from runs.webhooks import WebhookFailed, retry_delay, verify, webhook_deliver, webhook_notify
from tests.conftest import WorkerProcess, make_user, purge_broker, wait_for_run, wait_until

MAX_ATTEMPTS = 3  # the worker's and the test process's EXECGO_WEBHOOK_MAX_ATTEMPTS
# A high-risk plan (the seeded "install" rule) that is harmless once approved.
HIGH_RISK_PLAN = {"steps": [{"id": "s0", "tool": "shell", "params": {"argv": ["echo", "pip", "install", "requests"]}}]}


# --- a local receiver ----------------------------------------------------------


class Receiver:
    """Checks every request with ``runs.webhooks.verify`` against its own URL
    and the tenant secrets it is given (``secrets``: secret → tenant id);
    answers 503 to the first ``failures`` attempts of each delivery id (every
    attempt while ``down``), then 200, and records the valid requests it
    accepted (and, in ``signed_by``, which tenant's secret each verified with)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                code = receiver.answer(self.path, self.headers, body)
                self.send_response(code)
                if code == 302:
                    self.send_header("Location", "/hooks")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.origin = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.url = f"{self.origin}/hooks"
        self.secrets: dict[str, int] = {}

    def reset(self, *, failures: int = 2, down: bool = False) -> None:
        with self.lock:
            self.failures, self.down = failures, down
            self.attempts: Counter = Counter()  # delivery id → valid requests seen
            self.accepted: list[dict] = []  # the bodies answered 200
            self.invalid = 0
            self.paths: list[str] = []
            self.signed_by: dict[int, int] = {}  # delivery id → the tenant whose secret verified it

    def answer(self, path: str, headers, body: bytes) -> int:
        with self.lock:
            self.paths.append(path)
            signers = [tenant for secret, tenant in self.secrets.items()
                       if verify(secret, headers, body, url=self.origin + path)]
            if not signers:
                self.invalid += 1
                return 401
            envelope = json.loads(body)
            self.signed_by[envelope["id"]] = signers[0]
            assert headers["X-ExecGo-Delivery"] == str(envelope["id"])
            assert headers["X-ExecGo-Event"] == envelope["event"]
            assert headers["Content-Type"] == "application/json"
            if path == "/redirect":
                return 302
            self.attempts[envelope["id"]] += 1
            if self.down or self.attempts[envelope["id"]] <= self.failures:
                return 503
            self.accepted.append(envelope)
            return 200

    def accepted_for(self, request_id: int) -> Counter:
        with self.lock:
            return Counter(body["event"] for body in self.accepted if body["data"]["request"] == request_id)


@pytest.fixture(autouse=True)
def _echo_pip_install_waits_for_a_human(request):
    """HIGH_RISK_PLAN (an ``echo``) waits for approval by a rule of the tests' own."""
    if "seeded_policy" in request.fixturenames:
        request.getfixturevalue("echo_pip_install_is_high")


@pytest.fixture(scope="module")
def receiver_server():
    receiver = Receiver()
    threading.Thread(target=receiver.server.serve_forever, daemon=True).start()
    yield receiver
    receiver.server.shutdown()


@pytest.fixture
def receiver(receiver_server, tenant):
    receiver_server.reset()
    receiver_server.secrets = {tenant.webhook_secret: tenant.pk}
    return receiver_server


@pytest.fixture
def webhook_settings(settings, receiver_server):
    """The test process's side: it decides approvals and runs webhook_deliver in the in-process tests."""
    settings.EXECGO_APPROVAL_WEBHOOK_URL = receiver_server.url
    settings.EXECGO_WEBHOOK_MAX_ATTEMPTS = MAX_ATTEMPTS
    settings.EXECGO_WEBHOOK_BACKOFF_S = 0.2
    settings.EXECGO_WEBHOOK_TIMEOUT_S = 2.0
    return settings


# --- the row, in the caller's transaction ----------------------------------------


@pytest.mark.django_db
def test_notify_writes_the_row_in_the_callers_transaction(django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as sent:
        with transaction.atomic():
            webhook_notify("thing.happened", {"n": 1}, url="http://127.0.0.1:9/hooks")
    delivery = WebhookDelivery.objects.get()
    assert (delivery.event, delivery.payload, delivery.status, delivery.attempts) == (
        "thing.happened", {"n": 1}, WebhookStatus.PENDING, 0)
    assert len(sent) == 1  # the task is sent after commit (not run here)

    with django_capture_on_commit_callbacks() as sent:
        with pytest.raises(RuntimeError), transaction.atomic():
            webhook_notify("thing.happened", {"n": 2}, url="http://127.0.0.1:9/hooks")
            raise RuntimeError("the change rolls back")
    assert WebhookDelivery.objects.count() == 1 and sent == []  # rolled back with the change: nothing sent


def advance_to_approval(tenant, agent) -> ApprovalRequest:
    """A run driven in this thread by the real pipeline to AWAITING_HITL; its
    tasks (and webhooks) are sent on commit of the test's transaction, which
    never commits: nothing is sent."""
    run = run_submit(tenant=tenant, user=agent, plan=HIGH_RISK_PLAN).run
    assert run_advance(run.pk) is None
    assert Run.objects.get(pk=run.pk).state == "AWAITING_HITL"
    return ApprovalRequest.objects.get(run=run, status="pending")


def notifications(run_id: int) -> list[tuple[str, dict]]:
    return [(row.event, row.payload) for row in WebhookDelivery.objects.filter(run_id=run_id).order_by("id")]


@pytest.mark.django_db
def test_no_notification_without_url(settings, seeded_policy, tenant, agent, approver):
    settings.EXECGO_APPROVAL_WEBHOOK_URL = ""
    request = advance_to_approval(tenant, agent)
    approval_decide(request=request, digest=request.action_digest, actor=approver, approve=False, comment="no")
    assert ApprovalRequest.objects.get(pk=request.pk).status == "rejected"
    assert not WebhookDelivery.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("approve, status", [(True, "approved"), (False, "rejected")])
def test_a_decision_notifies_with_its_status(webhook_settings, seeded_policy, tenant, agent, approver, approve,
                                             status):
    request = advance_to_approval(tenant, agent)
    [(event, payload)] = notifications(request.run_id)
    assert event == "approval.requested" and payload["request"] == request.pk and payload["risk"] == "high"

    approval_decide(request=request, digest=request.action_digest, actor=approver, approve=approve, comment="looked at it")
    request.refresh_from_db()
    event, payload = notifications(request.run_id)[1]
    assert event == "approval.decided"
    assert payload == {"request": request.pk, "run": request.run_id, "tenant": tenant.pk, "status": status,
                       "decided_by": "approver", "comment": "looked at it", "reason": None,
                       "decided_at": request.decided_at.isoformat(), "url": f"/approvals/{request.pk}/"}
    assert len(notifications(request.run_id)) == 2


@pytest.mark.django_db
def test_a_decision_short_of_the_quorum_does_not_notify(webhook_settings, seeded_policy, tenant, agent, approver):
    request = advance_to_approval(tenant, agent)
    ApprovalRequest.objects.filter(pk=request.pk).update(approvals_required=2)
    request.refresh_from_db()
    approval_decide(request=request, digest=request.action_digest, actor=approver, approve=True)
    assert [event for event, _ in notifications(request.run_id)] == ["approval.requested"]


@pytest.mark.django_db
def test_expiry_notifies(webhook_settings, seeded_policy, tenant, agent):
    request = advance_to_approval(tenant, agent)
    assert approval_expire(request.pk, now=request.expires_at + timedelta(seconds=1)) is True
    event, payload = notifications(request.run_id)[-1]
    assert event == "approval.decided"
    assert (payload["status"], payload["decided_by"], payload["reason"]) == ("expired", None,
                                                                             "expired with no decision")


@pytest.mark.django_db
def test_a_voided_request_notifies(webhook_settings, seeded_policy, tenant, agent, approver):
    request = advance_to_approval(tenant, agent)
    rule = PolicyRule.objects.get(name="shell-chown")  # any change moves the policy version
    rule.reason = "changes file ownership (reviewed)"
    policy_rule_save(rule)
    with pytest.raises(ConflictError):
        approval_decide(request=request, digest=request.action_digest, actor=approver, approve=True)
    event, payload = notifications(request.run_id)[-1]
    assert event == "approval.decided"
    assert (payload["status"], payload["decided_by"]) == ("voided", "approver")
    assert "policy changed" in payload["reason"]


# --- one attempt at a time, in-process --------------------------------------------


def test_retry_delay_doubles_up_to_the_cap(settings):
    settings.EXECGO_WEBHOOK_BACKOFF_S = 1.5
    assert [retry_delay(attempts) for attempts in (1, 2, 3, 4)] == [1.5, 3.0, 6.0, 12.0]
    assert retry_delay(30) == 300


def delivery_to(url: str, tenant) -> WebhookDelivery:
    return WebhookDelivery.objects.create(event="thing.happened", url=url, payload={"request": 0}, tenant=tenant)


@pytest.mark.django_db
def test_failed_attempts_are_recorded_and_retried_until_delivered(webhook_settings, receiver, tenant):
    delivery = delivery_to(receiver.url, tenant)
    for attempt, expected_delay in ((1, 0.2), (2, 0.4)):
        with pytest.raises(WebhookFailed) as failed:
            webhook_deliver(delivery.pk)
        assert failed.value.retry_in == pytest.approx(expected_delay)
        delivery.refresh_from_db()
        assert (delivery.status, delivery.attempts, delivery.last_status_code) == ("pending", attempt, 503)
        assert delivery.last_error.startswith("HTTP 503")

    assert webhook_deliver(delivery.pk) is True
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.last_status_code, delivery.last_error) == (
        "delivered", 3, 200, "")
    assert delivery.delivered_at is not None
    assert receiver.invalid == 0 and len(receiver.accepted) == 1
    body = receiver.accepted[0]
    assert body["id"] == delivery.pk and body["event"] == "thing.happened" and body["data"] == {"request": 0}

    # A duplicate of the task finds it delivered: nothing is sent again.
    assert webhook_deliver(delivery.pk) is True
    assert receiver.attempts[delivery.pk] == 3
    delivery.refresh_from_db()
    assert delivery.attempts == 3


@pytest.mark.django_db
def test_a_receiver_that_always_fails_ends_failed(webhook_settings, receiver, tenant):
    receiver.reset(down=True)
    delivery = delivery_to(receiver.url, tenant)
    for _ in range(MAX_ATTEMPTS - 1):
        with pytest.raises(WebhookFailed):
            webhook_deliver(delivery.pk)
    assert webhook_deliver(delivery.pk) is False  # the last attempt gives up instead of asking for a retry
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.last_status_code) == ("failed", MAX_ATTEMPTS, 503)
    assert delivery.delivered_at is None

    assert webhook_deliver(delivery.pk) is False  # failed is final
    assert receiver.attempts[delivery.pk] == MAX_ATTEMPTS


@pytest.mark.django_db
def test_unreachable_receiver_redirects_and_bad_schemes(webhook_settings, receiver, tenant):
    unreachable = delivery_to("http://127.0.0.1:9/hooks", tenant)  # the discard port: nobody listens
    with pytest.raises(WebhookFailed):
        webhook_deliver(unreachable.pk)
    unreachable.refresh_from_db()
    assert unreachable.last_status_code is None and unreachable.last_error

    redirected = delivery_to(receiver.url.replace("/hooks", "/redirect"), tenant)
    with pytest.raises(WebhookFailed):
        webhook_deliver(redirected.pk)
    redirected.refresh_from_db()
    assert redirected.last_status_code == 302
    assert receiver.paths == ["/redirect"]  # not followed

    local_file = delivery_to("file:///etc/passwd", tenant)
    assert webhook_deliver(local_file.pk) is False
    local_file.refresh_from_db()
    assert local_file.status == "failed" and local_file.attempts == 1


@pytest.mark.django_db
def test_a_delivery_of_no_tenant_is_never_sent(webhook_settings, receiver):
    """Its tenant was deleted: there is no secret to sign it with, and none
    to fall back on."""
    delivery = delivery_to(receiver.url, None)
    assert webhook_deliver(delivery.pk) is False
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.last_status_code) == ("failed", 1, None)
    assert "no tenant" in delivery.last_error
    assert receiver.paths == []


@pytest.mark.django_db
def test_admin_lists_deliveries_read_only(admin_client):
    delivery = WebhookDelivery.objects.create(event="approval.requested", url="https://hooks.example/x",
                                              payload={"request": 1}, status=WebhookStatus.FAILED, attempts=8)
    listing = admin_client.get(reverse("admin:runs_webhookdelivery_changelist"), {"status__exact": "failed",
                                                                                   "q": "approval"})
    assert listing.status_code == 200
    assert [row.pk for row in listing.context["cl"].result_list] == [delivery.pk]
    detail = admin_client.get(reverse("admin:runs_webhookdelivery_change", args=[delivery.pk]))
    assert detail.status_code == 200 and b"&quot;request&quot;: 1" in detail.content
    assert admin_client.get(reverse("admin:runs_webhookdelivery_add")).status_code == 403
    assert admin_client.post(reverse("admin:runs_webhookdelivery_delete", args=[delivery.pk]),
                             {"post": "yes"}).status_code == 403


# --- on a real worker ----------------------------------------------------------------


@pytest.fixture(scope="module")
def webhook_worker(django_db_setup, django_db_blocker, receiver_server):
    """A worker of its own: the pipeline it runs opens the approval requests,
    so it needs the URL and the secret; it also delivers every webhook."""
    with django_db_blocker.unblock():
        purge_broker()
        worker = WorkerProcess(hostname="webhooks", env={
            "EXECGO_APPROVAL_WEBHOOK_URL": receiver_server.url,
            "EXECGO_WEBHOOK_BACKOFF_S": "0.2", "EXECGO_WEBHOOK_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
            "EXECGO_WEBHOOK_TIMEOUT_S": "2",
        }).start()
    yield worker
    worker.stop()


@pytest.fixture
def approver(tenant):
    return make_user("approver", tenant, groups=(APPROVERS_GROUP,))


def wait_for_delivery(event: str, request: ApprovalRequest, *, status: str) -> WebhookDelivery:
    def reached() -> bool:
        return WebhookDelivery.objects.filter(event=event, run_id=request.run_id, status=status).exists()

    wait_until(reached, timeout=30, what=f"{event} of request {request.pk} {status}")
    return WebhookDelivery.objects.get(event=event, run_id=request.run_id)


@pytest.mark.django_db(transaction=True)
def test_approval_notifications_are_delivered_despite_failures(webhook_worker, webhook_settings, receiver,
                                                               seeded_policy, tenant, agent, approver):
    run_id = run_submit(tenant=tenant, user=agent, plan=HIGH_RISK_PLAN).run.pk
    wait_for_run(run_id, states={"AWAITING_HITL"})
    request = ApprovalRequest.objects.get(run_id=run_id, status="pending")
    requested = wait_for_delivery("approval.requested", request, status="delivered")

    approval_decide(request=request, digest=request.action_digest, actor=approver, approve=True, comment="fine by me")
    decided = wait_for_delivery("approval.decided", request, status="delivered")
    run = wait_for_run(run_id)

    assert run.state == "SUCCEEDED"  # the notifications never held the run up
    assert receiver.invalid == 0
    assert receiver.accepted_for(request.pk) == {"approval.requested": 1, "approval.decided": 1}
    for delivery in (requested, decided):
        assert (delivery.status, delivery.attempts, delivery.last_status_code) == ("delivered", 3, 200)
        assert delivery.tenant_id == tenant.pk and delivery.url == receiver.url
        assert receiver.attempts[delivery.pk] == 3  # two 503s, then the 200

    bodies = {body["event"]: body for body in receiver.accepted if body["data"]["request"] == request.pk}
    asked = bodies["approval.requested"]["data"]
    assert asked == {
        "request": request.pk, "run": run_id, "tenant": tenant.pk, "risk": "high",
        "action_digest": request.action_digest, "approvals_required": 1,
        "expires_at": request.expires_at.isoformat(), "actions": [step["action"] for step in request.steps],
        "url": f"/approvals/{request.pk}/",
    }
    assert asked["actions"][0]["argv"] == ["echo", "pip", "install", "requests"]
    answer = bodies["approval.decided"]["data"]
    assert (answer["status"], answer["decided_by"], answer["comment"]) == ("approved", "approver", "fine by me")
    assert answer["request"] == request.pk and answer["url"] == f"/approvals/{request.pk}/"


@pytest.mark.django_db(transaction=True)
def test_a_receiver_that_is_down_never_changes_the_run(webhook_worker, webhook_settings, receiver, seeded_policy,
                                                       tenant, agent, approver):
    receiver.reset(down=True)
    run_id = run_submit(tenant=tenant, user=agent, plan=HIGH_RISK_PLAN).run.pk
    waiting = wait_for_run(run_id, states={"AWAITING_HITL"})
    request = ApprovalRequest.objects.get(run_id=run_id, status="pending")
    audit_rows = list(AuditLog.objects.filter(run_id=run_id).values_list("pk", flat=True))
    traces = waiting.traces.count()

    requested = wait_for_delivery("approval.requested", request, status="failed")
    assert (requested.attempts, requested.last_status_code, requested.delivered_at) == (MAX_ATTEMPTS, 503, None)
    time.sleep(1.5)  # longer than the next backoff would be: a failed row is never sent again
    assert receiver.attempts[requested.pk] == MAX_ATTEMPTS

    run = Run.objects.get(pk=run_id)
    assert (run.state, run.last_state_change_at) == ("AWAITING_HITL", waiting.last_state_change_at)
    assert run.traces.count() == traces
    assert list(AuditLog.objects.filter(run_id=run_id).values_list("pk", flat=True)) == audit_rows
    assert ApprovalRequest.objects.get(pk=request.pk).status == "pending"

    # The decision still takes effect; its own notification fails on its own.
    approval_decide(request=request, digest=request.action_digest, actor=approver, approve=False, comment="no")
    assert wait_for_run(run_id).state == "CLOSED_REJECTED"
    decided = wait_for_delivery("approval.decided", request, status="failed")
    assert decided.attempts == MAX_ATTEMPTS
    assert receiver.accepted_for(request.pk) == {} and receiver.invalid == 0
