"""Notifications to approvers and their one-time decision links
(docs/approvals.md#notifications).

``notify_request`` writes, in the caller's transaction, one
``Notification`` row per approver and channel (e-mail to the account's
address, chat to the approver's incoming webhook) and, for a request still
open, one ``DecisionLink`` per message; after commit each row is sent by
the ``approvals.tasks.send_notification`` task, retried with backoff up to
``EXECGO_NOTIFY_MAX_ATTEMPTS``, its outcome kept on the row. Who is told:
the tenant's approvers, never the run's submitter nor an agent identity.

A decision link's URL carries a token signed with the project's key over
the link's id and a random secret; the row keeps only the secret's digest.
A new secret is drawn for each attempt at sending, so a link is valid in
the last message sent. What a link may do is ``approvals.links``'.
"""

import hashlib
import http.client
import json
import logging
import secrets
import smtplib
import urllib.error
import urllib.parse
import urllib.request
from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core import signing
from django.core.mail import EmailMessage
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from approvals.models import (
    AGENTS_GROUP,
    APPROVERS_GROUP,
    ApprovalRequest,
    ChatFormat,
    DecisionLink,
    Notification,
    NotificationChannel,
    NotificationKind,
    NotificationSettings,
    NotificationStatus,
)
from runs.dispatch import enqueue_notification

logger = logging.getLogger(__name__)
LINK_SALT = "execgo.approvals.decision-link"
LINK_PLACEHOLDER = "{decision_link}"
OPEN_KINDS = {NotificationKind.REQUESTED, NotificationKind.REMINDER, NotificationKind.ESCALATION}
HEADLINES = {
    NotificationKind.REQUESTED: "Approval needed",
    NotificationKind.REMINDER: "Reminder: approval still needed",
    NotificationKind.ESCALATION: "Escalated: approval still needed",
    NotificationKind.DECIDED: "Decided",
    NotificationKind.EXPIRED: "Expired with no decision",
}


class SendFailed(Exception):
    """An attempt failed; another is due unless the row says ``failed``."""


def approvers_of(request: ApprovalRequest):
    """The people who may decide ``request``: active approvers of its
    tenant, not agents, not the run's submitter."""
    return (get_user_model().objects.filter(is_active=True, membership__tenant_id=request.tenant_id,
                                            groups__name=APPROVERS_GROUP)
            .exclude(groups__name=AGENTS_GROUP).exclude(pk=request.run.submitted_by_id).distinct())


def told_of(request: ApprovalRequest):
    """The people told that ``request`` was opened."""
    return get_user_model().objects.filter(pk__in=Notification.objects.filter(
        request=request, kind=NotificationKind.REQUESTED).values("recipient_id"))


def with_delegates(request: ApprovalRequest, people) -> list:
    """``people``, each replaced by their delegate while they are away
    (docs/approvals.md#delegation), each person once. A delegate who may
    not decide this request (the run's submitter, no longer an approver of
    the tenant) is passed over: the away approver is told themselves."""
    now = timezone.now()
    may_decide = {user.pk for user in approvers_of(request)}
    away = {prefs.user_id: prefs.delegate for prefs in NotificationSettings.objects.filter(
        user__in=[user.pk for user in people]).select_related("delegate") if prefs.away(now)}
    told, seen = [], set()
    for user in people:
        delegate = away.get(user.pk)
        target = delegate if delegate is not None and delegate.pk in may_decide else user
        if target.pk not in seen:
            seen.add(target.pk)
            told.append(target)
    return told


def channels_of(user) -> list[tuple[str, str]]:
    prefs = NotificationSettings.objects.filter(user=user).first()
    channels = []
    if (prefs is None or prefs.email) and user.email:
        channels.append((NotificationChannel.EMAIL, user.email))
    if prefs is not None and prefs.chat_url:
        channels.append((NotificationChannel.CHAT, prefs.chat_url))
    return channels


def notify_request(request: ApprovalRequest, kind: str, *, recipients=None) -> list[Notification]:
    """In the caller's transaction: the messages of ``kind`` about
    ``request`` to each of ``recipients`` (default: its approvers), sent
    once the transaction commits."""
    subject, body = message_of(request, kind)
    made = []
    people = list(recipients if recipients is not None else approvers_of(request))
    if kind in (NotificationKind.REQUESTED, NotificationKind.REMINDER):
        people = with_delegates(request, people)
    for user in people:
        channels = channels_of(user)
        if not channels:
            continue
        for channel, address in channels:  # a link per message: each is sent with a secret of its own
            link = None
            if kind in OPEN_KINDS:
                link = DecisionLink.objects.create(tenant_id=request.tenant_id, request=request, recipient=user,
                                                   digest=request.action_digest, secret_sha256="",
                                                   expires_at=request.expires_at)
            made.append(Notification.objects.create(
                tenant_id=request.tenant_id, request=request, recipient=user, kind=kind, channel=channel,
                address=address, subject=subject, body=body, link=link))
    for notification in made:
        enqueue_notification(notification.pk)
    return made


def message_of(request: ApprovalRequest, kind: str) -> tuple[str, str]:
    """The subject and body (one line each for the run, the risk and its
    reasons, and the time left; the link where it is to be decided)."""
    run = request.run
    title = f' "{run.title}"' if run.title else ""
    reasons = "; ".join(dict.fromkeys(reason for step in request.steps if step.get("risk") in ("high", "deny")
                                      for reason in step.get("reasons", []) if not reason.startswith("baseline ")))
    left = request.expires_at - timezone.now()
    hours, minutes = divmod(max(int(left.total_seconds()), 0) // 60, 60)
    lines = [f"Run: #{run.pk}{title}, submitted by {run.submitted_by.get_username() if run.submitted_by else '?'}",
             f"Risk: {request.risk}: {reasons or 'see the request'}"]
    if kind in OPEN_KINDS:
        lines += [f"Time left: {hours} h {minutes:02d} min (expires {request.expires_at:%Y-%m-%d %H:%M} UTC)",
                  f"Decide: {LINK_PLACEHOLDER}",
                  "The link shows the request; nothing is decided until you press Approve or Reject."]
    else:
        lines.append(f"Outcome: request #{request.pk} is {request.status}")
    lines.append(f"Request: {public_url(f'/approvals/{request.pk}/')}")
    subject = f"[ExecGo] {HEADLINES[kind]}: run #{run.pk}{title} ({request.risk})"
    return subject[:300], "\n".join(lines)


def public_url(path: str) -> str:
    return settings.EXECGO_PUBLIC_URL.rstrip("/") + path


def link_token(link: DecisionLink) -> str:
    """A fresh token for ``link`` (its secret replaced): what its URL carries."""
    secret = secrets.token_urlsafe(24)
    DecisionLink.objects.filter(pk=link.pk).update(secret_sha256=hashlib.sha256(secret.encode()).hexdigest())
    return signing.dumps({"link": link.pk, "secret": secret}, salt=LINK_SALT, compress=True)


def link_of(token: str) -> DecisionLink | None:
    """The link a token names, when its signature and secret hold; None otherwise."""
    try:
        data = signing.loads(token, salt=LINK_SALT)
        link_id, secret = int(data["link"]), str(data["secret"])
    except (signing.BadSignature, KeyError, TypeError, ValueError):
        return None
    link = DecisionLink.objects.select_related("request", "request__run", "recipient").filter(pk=link_id).first()
    if link is None or not secrets.compare_digest(link.secret_sha256,
                                                  hashlib.sha256(secret.encode()).hexdigest()):
        return None
    return link


def notification_send(notification_id: int) -> bool:
    """One attempt at sending a pending row: True once sent (or nothing to
    do); raises ``SendFailed`` when it failed and another attempt is due."""
    with transaction.atomic():
        row = Notification.objects.select_for_update().filter(pk=notification_id).first()
        if row is None or row.status != NotificationStatus.PENDING:
            return True
        Notification.objects.filter(pk=row.pk).update(attempts=F("attempts") + 1)  # counted even if this dies
    row.refresh_from_db()
    body = row.body
    if row.link_id is not None:
        link = DecisionLink.objects.get(pk=row.link_id)
        body = body.replace(LINK_PLACEHOLDER, public_url(f"/approvals/link/{link_token(link)}/"))
    try:
        _send_email(row, body) if row.channel == NotificationChannel.EMAIL else _send_chat(row, body)
    except (OSError, ValueError, smtplib.SMTPException, http.client.HTTPException, urllib.error.URLError,
            SendFailed) as exc:
        error = f"{exc.__class__.__name__}: {exc}"[:500]
        final = row.attempts >= settings.EXECGO_NOTIFY_MAX_ATTEMPTS
        Notification.objects.filter(pk=row.pk).update(
            last_error=error, **({"status": NotificationStatus.FAILED} if final else {}))
        logger.warning("notification %s (%s, %s) attempt %s failed: %s", row.pk, row.kind, row.channel, row.attempts,
                       error)
        if final:
            return True
        raise SendFailed(error) from exc
    Notification.objects.filter(pk=row.pk).update(status=NotificationStatus.SENT, sent_at=timezone.now(),
                                                  last_error="")
    return True


def retry_delay(attempts: int) -> float:
    return min(settings.EXECGO_NOTIFY_RETRY_BASE_S * 2 ** (attempts - 1), 600)


def _send_email(row: Notification, body: str) -> None:
    EmailMessage(subject=row.subject, body=body, to=[row.address]).send(fail_silently=False)


def _send_chat(row: Notification, body: str) -> None:
    host = (urllib.parse.urlsplit(row.address).hostname or "").lower()
    if not chat_host_allowed(host):
        raise SendFailed(f"{host or 'the URL'} is not on EXECGO_CHAT_WEBHOOK_HOSTS")
    text = f"*{row.subject}*\n{body}"
    payload = {"text": text} if _format_of(row) == ChatFormat.SLACK else {
        "@type": "MessageCard", "@context": "https://schema.org/extensions", "summary": row.subject,
        "title": row.subject, "text": body.replace("\n", "  \n")}
    request = urllib.request.Request(row.address, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "User-Agent": "ExecGo-Notify/1"})
    try:
        with _opener.open(request, timeout=settings.EXECGO_NOTIFY_TIMEOUT_S) as response:
            response.read(2000)
    except urllib.error.HTTPError as answer:  # a non-2xx answer (a redirect included: never followed)
        raise SendFailed(f"HTTP {answer.code} from the chat webhook") from None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_opener = urllib.request.build_opener(_NoRedirect)


def _format_of(row: Notification) -> str:
    prefs = NotificationSettings.objects.filter(user_id=row.recipient_id).first()
    return prefs.chat_format if prefs is not None else ChatFormat.SLACK


def chat_host_allowed(host: str) -> bool:
    """Chat goes only to the operator's list of webhook hosts (an entry
    ``.example.com`` also allows its subdomains): an approver's URL never
    makes the worker reach anything else."""
    for allowed in settings.EXECGO_CHAT_WEBHOOK_HOSTS:
        allowed = allowed.strip().lower()
        if allowed and (host == allowed or (allowed.startswith(".") and host.endswith(allowed))):
            return True
    return False


def pending_notifications(older_than_s: float):
    """Rows still pending a while after they were made: their message was lost (the relay sends them again)."""
    return Notification.objects.filter(status=NotificationStatus.PENDING,
                                       created_at__lt=timezone.now() - timedelta(seconds=older_than_s))
