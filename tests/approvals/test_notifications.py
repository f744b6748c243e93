"""Notifications and one-time decision links: the right people are told
(never the submitter, never an agent), each message says the run, the risk
and its reasons and the time left, and carries a link of its own; opening a
link decides nothing, its approver's POST decides once, and every refused
use (someone else's link, reused, expired, a plan that changed) is refused
and audited. Against a real SMTP server and chat receiver on loopback and
a real worker: tests/approvals/test_notifications_delivery.py."""

import re
from datetime import timedelta

import pytest
from django.core import mail
from django.utils import timezone

from approvals.models import ApprovalRequest, DecisionLink, Notification, NotificationSettings
from approvals.notify import notification_send
from runs.models import AuditLog, Run
from tests.approvals.decisions_helpers import pending_request
from tests.approvals.interfaces_helpers import signed_in
from tests.conftest import make_person

pytestmark = pytest.mark.django_db

LINK = re.compile(r"Decide: http://testserver(/approvals/link/[^/\s]+/)")


@pytest.fixture(autouse=True)
def _mail(settings):
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    settings.EXECGO_PUBLIC_URL = "http://testserver"
    settings.EXECGO_CHAT_WEBHOOK_HOSTS = ["hooks.example.com"]



@pytest.fixture
def people(tenant, other_tenant):
    return {"ann": make_person("ann", tenant, "approvers"), "ben": make_person("ben", tenant, "approvers"),
            "bot": make_person("bot", tenant, "approvers", "agents"), "dev": make_person("dev", tenant),
            "eve": make_person("eve", other_tenant, "approvers")}


@pytest.fixture
def opened(people, awaiting, tenant):
    """A request opened by the real pipeline, its notifications written (sent below, by hand)."""
    return pending_request(awaiting())


def send_all() -> None:
    for notification in Notification.objects.order_by("id"):
        assert notification_send(notification.pk)


def link_for(name: str) -> str:
    [message] = [message for message in mail.outbox if message.to == [f"{name}@example.com"]]
    return LINK.search(message.body).group(1)


def test_the_tenant_s_approvers_are_told_with_a_link_each_and_nobody_else(opened, people, agent):
    rows = Notification.objects.filter(request=opened)
    assert sorted(rows.values_list("recipient__username", "kind", "channel")) == [
        ("ann", "requested", "email"), ("ben", "requested", "email")]
    assert DecisionLink.objects.filter(request=opened).count() == 2
    send_all()
    assert sorted(message.to[0] for message in mail.outbox) == ["ann@example.com", "ben@example.com"]
    message = mail.outbox[0]
    run = Run.objects.get(pk=opened.run_id)
    assert message.subject == f"[ExecGo] Approval needed: run #{run.pk} ({opened.risk})"
    lines = message.body.splitlines()
    assert lines[0] == f"Run: #{run.pk}, submitted by {agent.username}"
    assert lines[1].startswith("Risk: high: shell-package-install: installs packages")
    assert re.match(r"Time left: 0 h 1[45] min \(expires ", lines[2]), lines[2]
    assert link_for("ann") != link_for("ben")
    assert Notification.objects.filter(status="sent").count() == 2
    assert "/approvals/link/" not in "".join(Notification.objects.values_list("body", flat=True))  # never stored


def test_opening_a_link_decides_nothing_and_its_approver_s_post_decides_once(opened, people):
    send_all()
    url = link_for("ann")
    scanner = signed_in(people["ann"]).__class__()  # no session: a mail scanner, a chat unfurler
    answer = scanner.get(url)
    assert answer.status_code == 302 and answer["Location"].startswith("/accounts/login/")
    ann = signed_in(people["ann"])
    page = ann.get(url)
    assert page.status_code == 200 and b"Approve" in page.content and opened.action_digest.encode() in page.content
    assert ApprovalRequest.objects.get(pk=opened.pk).status == "pending"

    decided = ann.post(url, {"verdict": "approve", "comment": "from the mail"})
    assert decided.status_code == 302
    opened.refresh_from_db()
    assert opened.status == "approved"
    assert list(opened.decisions.values_list("decider__username", "comment")) == [("ann", "from the mail")]
    assert AuditLog.objects.filter(event="decision_link_used", data__request=opened.pk, actor=people["ann"]).exists()
    # The outcome is told to those told of the request.
    assert sorted(Notification.objects.filter(request=opened, kind="decided").values_list(
        "recipient__username", flat=True)) == ["ann", "ben"]

    again = ann.post(url, {"verdict": "approve"})
    assert again.status_code == 409 and b"used already" in again.content
    assert AuditLog.objects.filter(event="decision_link_refused", data__reason="this link was used already").exists()


def test_someone_else_s_an_expired_and_a_stale_link_are_refused_and_audited(opened, people, tenant):
    send_all()
    ann_link, ben_link = link_for("ann"), link_for("ben")
    ben = signed_in(people["ben"])
    for method in ("get", "post"):
        refused = getattr(ben, method)(ann_link, {"verdict": "approve"} if method == "post" else None)
        assert refused.status_code == 403 and b"sent to someone else" in refused.content
    assert AuditLog.objects.filter(event="decision_link_refused", actor=people["ben"],
                                   data__reason="this link was sent to someone else").count() == 2
    eve = signed_in(people["eve"])
    assert eve.get(ann_link).status_code == 403

    DecisionLink.objects.filter(recipient=people["ben"]).update(expires_at=timezone.now() - timedelta(seconds=1))
    expired = ben.post(ben_link, {"verdict": "approve"})
    assert expired.status_code == 409 and b"expired" in expired.content

    ApprovalRequest.objects.filter(pk=opened.pk).update(action_digest="f" * 64)  # the plan changed
    stale = signed_in(people["ann"]).post(ann_link, {"verdict": "approve"})
    assert stale.status_code == 409 and b"plan changed" in stale.content
    assert ApprovalRequest.objects.get(pk=opened.pk).status == "pending" and not opened.decisions.exists()
    assert AuditLog.objects.filter(event="decision_link_refused").count() == 5

    forged = ann_link[:-8] + "AAAAAAA/"
    assert signed_in(people["ann"]).get(forged).status_code == 404


def test_a_reject_through_a_link_needs_a_reason_and_keeps_the_link_until_it_has_one(opened, people):
    send_all()
    url, ann = link_for("ann"), signed_in(people["ann"])
    ann.post(url, {"verdict": "reject", "comment": ""})
    assert ApprovalRequest.objects.get(pk=opened.pk).status == "pending"
    assert ann.post(url, {"verdict": "reject", "comment": "not now"}).status_code == 302
    assert ApprovalRequest.objects.get(pk=opened.pk).status == "rejected"


def test_each_approver_chooses_channels_and_a_chat_url_must_be_on_the_operator_s_list(people, awaiting):
    ann = signed_in(people["ann"], enforce_csrf_checks=False)
    refused = ann.post("/approvals/settings/", {"email": "on", "chat_url": "http://127.0.0.1:5432/x",
                                                "chat_format": "slack"})
    assert refused.status_code == 200 and "chat_url" in refused.context["form"].errors
    assert ann.post("/approvals/settings/", {"chat_url": "https://hooks.example.com/T1/B2",
                                             "chat_format": "teams"}).status_code == 302
    prefs = NotificationSettings.objects.get(user=people["ann"])
    assert (prefs.email, prefs.chat_url, prefs.chat_format) == (False, "https://hooks.example.com/T1/B2", "teams")
    request = pending_request(awaiting())
    assert sorted(Notification.objects.filter(request=request).values_list("recipient__username", "channel")) == [
        ("ann", "chat"), ("ben", "email")]
    assert signed_in(people["dev"]).get("/approvals/settings/").status_code == 403


def test_link_sign_in_opens_a_session_good_for_that_one_request_only(opened, people, settings):
    settings.EXECGO_DECISION_LINK_SIGN_IN = True
    send_all()
    url = link_for("ann")
    people["ben"].is_active = False  # a disabled account is never signed in by its link
    people["ben"].save()
    disabled = signed_in(people["ann"]).__class__().get(link_for("ben"))
    assert disabled.status_code == 410 and b"disabled" in disabled.content
    browser = signed_in(people["ann"]).__class__()  # not signed in
    first = browser.get(url)  # a scanner's fetch: names the approver, shows nothing, signs nobody in
    assert first.status_code == 200 and b"Continue as ann" in first.content
    assert opened.action_digest.encode() not in first.content and "_auth_user_id" not in browser.session
    assert browser.post(url, {"sign_in": "1"}).status_code == 302
    assert AuditLog.objects.filter(event="decision_link_sign_in", actor=people["ann"]).count() == 1
    page = browser.get(url)
    assert page.status_code == 200 and opened.action_digest.encode() in page.content
    for elsewhere in ("/approvals/", f"/approvals/{opened.pk}/", "/api/v1/runs", "/admin/", "/runs/"):
        assert browser.get(elsewhere).status_code == 403, elsewhere
    done = browser.post(url, {"verdict": "approve"})
    assert done.status_code == 200 and b"signed out" in done.content
    assert ApprovalRequest.objects.get(pk=opened.pk).status == "approved"
    assert browser.get("/approvals/").status_code == 302  # to the login page: the session ended

    spent = signed_in(people["ann"]).__class__().get(url)
    assert spent.status_code == 410 and b"used already" in spent.content
