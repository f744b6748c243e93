"""Outgoing webhooks: signed, retried, recorded.

``webhook_notify`` writes a ``WebhookDelivery`` row in the caller's
transaction (the outbox pattern: the notification commits with the change it
reports, or not at all) and, once that transaction has committed, sends the
``runs.tasks.deliver_webhook`` task by name. The task calls
``webhook_deliver``, which POSTs the row and records the outcome; a failed
attempt is retried with exponential backoff until
``EXECGO_WEBHOOK_MAX_ATTEMPTS``, then the row is marked ``failed``. A
delivered or failed row is never sent again. Nothing here touches a run: a
receiver that is down only leaves its rows ``failed``.

Delivery is at least once: two copies of the task (a worker that died after
the POST, before the ack) may both POST. Every attempt of one delivery
carries the same ``X-ExecGo-Delivery`` id, so a receiver deduplicates on it.

The request
-----------

``POST <url>`` with ``Content-Type: application/json`` and the body::

    {"id": <delivery id>, "event": "approval.requested", "created_at": "<ISO 8601>", "data": {...}}

and the headers ``X-ExecGo-Event`` (the event), ``X-ExecGo-Delivery`` (the
id), ``X-ExecGo-Timestamp`` (unix seconds of this attempt) and
``X-ExecGo-Signature: sha256=<hex>``, where the hex is
``HMAC-SHA256(tenant.webhook_secret, f"{timestamp}.{url}.".encode() + body)``.

The key is the secret of the delivery's tenant (``Tenant.webhook_secret``:
each tenant has its own, shown to its staff and rotated in the admin), read
at each attempt, so a rotation applies to every attempt after it, those of
deliveries already queued included. A delivery of no tenant (its tenant was
deleted) has nothing to be signed with and is marked ``failed``. The signed
content names the URL the request was sent to, exactly as ExecGo holds it:
a request captured on its way to one receiver does not verify at another
that shares the tenant's secret. The timestamp, the URL and the body are
signed: a receiver reads the event and the id from the (signed) body, not
from the headers.

Checking a request (what ``verify`` does)
-----------------------------------------

1. Read the raw body bytes; do not re-serialise the parsed JSON.
2. Recompute the HMAC over ``b"<timestamp>.<url>." + body`` with the
   tenant's secret and the receiver's own URL as configured in ExecGo, and
   compare it to the signature header with ``hmac.compare_digest``
   (constant time; ``==`` leaks how many leading characters matched).
3. Refuse a timestamp more than ``tolerance_s`` (300) seconds from now, so a
   captured request cannot be replayed later; within the window, deduplicate
   on the delivery id.
4. Answer 2xx once the event is stored; anything else (or no answer within
   ``EXECGO_WEBHOOK_TIMEOUT_S``) is retried. Redirects are not followed.
"""

import hashlib
import hmac
import http.client
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from urllib.parse import urlsplit

from celery import current_app
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from runs.audit import audit
from runs.models import AuditEvent, Run, Step, Tenant, WebhookDelivery, WebhookStatus
from runs.models.run import new_webhook_secret

logger = logging.getLogger(__name__)

DELIVER_WEBHOOK = "runs.tasks.deliver_webhook"
BACKOFF_MAX_S = 300
ERROR_CHARS = 500  # of a failed attempt's error (and of the receiver's answer) kept on the row

SIGNATURE_HEADER = "X-ExecGo-Signature"
TIMESTAMP_HEADER = "X-ExecGo-Timestamp"
EVENT_HEADER = "X-ExecGo-Event"
DELIVERY_HEADER = "X-ExecGo-Delivery"


class WebhookFailed(Exception):
    """An attempt that did not get a 2xx answer and will be retried in ``retry_in`` seconds."""

    def __init__(self, message: str, *, retry_in: float):
        super().__init__(message)
        self.retry_in = retry_in


def webhook_configured(url: str) -> bool:
    """Whether notifications to ``url`` can be sent (every tenant has a secret to sign them with)."""
    return bool(url)


def webhook_secret_rotate(*, tenant: Tenant, actor) -> None:
    """Give ``tenant`` a new webhook secret, audited (never the secret
    itself). Every attempt from now on is signed with it."""
    with transaction.atomic():
        Tenant.objects.filter(pk=tenant.pk).update(webhook_secret=new_webhook_secret())
        audit(AuditEvent.ADMIN_CHANGED, run_id=None, tenant_id=tenant.pk, actor=actor, caller="admin", data={
            "model": "runs.tenant", "object_id": str(tenant.pk), "object_repr": str(tenant)[:200],
            "action": "changed", "before": None, "after": {"webhook_secret": "webhook_secret rotated"},
            "changed_fields": ["webhook_secret"],
        })
    tenant.refresh_from_db(fields=["webhook_secret"])


def webhook_notify(event: str, payload: dict, *, url: str, run_id: int | None = None,
                   tenant_id: int | None = None) -> None:
    """Record a notification in the caller's transaction; it is sent once that commits."""
    delivery = WebhookDelivery.objects.create(event=event, url=url, payload=payload, run_id=run_id,
                                              tenant_id=tenant_id)
    # Sent by name, after commit, as runs.dispatch does (the worker must find
    # the row; this module sits below runs.tasks and never imports it). A
    # signature resolves to the registered task where this process has it, so
    # CELERY_TASK_ALWAYS_EAGER delivers inline.
    transaction.on_commit(lambda pk=delivery.pk: current_app.signature(DELIVER_WEBHOOK, args=(pk,)).apply_async())


def sign(secret: str, timestamp: int, url: str, body: bytes) -> str:
    """The hex HMAC-SHA256 of ``b"<timestamp>.<url>." + body``."""
    return hmac.new(secret.encode(), f"{timestamp}.{url}.".encode() + body, hashlib.sha256).hexdigest()


def verify(secret: str, headers: Mapping[str, str], body: bytes, *, url: str, tolerance_s: int = 300,
           now: float | None = None) -> bool:
    """Whether a request to ``url`` carries a valid signature of ``body`` by
    ``secret``, made within ``tolerance_s`` of ``now``. Header names are
    matched without regard to case (``headers`` may be a dict or an
    ``http.client`` message)."""
    if not secret:
        return False
    lowered = {str(name).lower(): value for name, value in headers.items()}
    signature = lowered.get(SIGNATURE_HEADER.lower()) or ""
    try:
        timestamp = int(lowered.get(TIMESTAMP_HEADER.lower()) or "")
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance_s:
        return False  # outside the replay window
    expected = f"sha256={sign(secret, timestamp, url, body)}"
    return hmac.compare_digest(expected.encode(), signature.encode())


def retry_delay(attempts: int) -> float:
    """Seconds before the next attempt, after ``attempts`` failed ones."""
    return min(settings.EXECGO_WEBHOOK_BACKOFF_S * 2 ** max(attempts - 1, 0), BACKOFF_MAX_S)


def webhook_deliver(delivery_id: int) -> bool:
    """One attempt at delivering a pending row. True once it is delivered;
    False when there is nothing (more) to send: no such row, or it is failed.
    Raises ``WebhookFailed`` when the attempt failed and another is due."""
    with transaction.atomic():
        delivery = WebhookDelivery.objects.select_for_update().filter(pk=delivery_id).first()
        if delivery is None or delivery.status != WebhookStatus.PENDING:
            # A duplicate of a finished delivery: never sent again.
            return delivery is not None and delivery.status == WebhookStatus.DELIVERED
        # Counted before sending, so an attempt that kills its worker still counts.
        delivery.attempts += 1
        delivery.save(update_fields=["attempts"])
    # The HTTP call holds no transaction and no lock.
    status_code, error, permanent = _post(delivery)
    delivered = status_code is not None and 200 <= status_code < 300
    with transaction.atomic():
        row = WebhookDelivery.objects.select_for_update().get(pk=delivery_id)
        if row.status != WebhookStatus.PENDING:
            return row.status == WebhookStatus.DELIVERED  # a concurrent copy finished it
        row.last_status_code, row.last_error = status_code, "" if delivered else error
        if delivered:
            row.status, row.delivered_at = WebhookStatus.DELIVERED, timezone.now()
        elif permanent or row.attempts >= settings.EXECGO_WEBHOOK_MAX_ATTEMPTS:
            row.status = WebhookStatus.FAILED
        row.save(update_fields=["last_status_code", "last_error", "status", "delivered_at"])
    if delivered:
        logger.info("webhook %s %s delivered (attempt %s, HTTP %s)", row.pk, row.event, row.attempts, status_code)
        return True
    if row.status == WebhookStatus.FAILED:
        logger.warning("webhook %s %s failed after %s attempt(s): %s", row.pk, row.event, row.attempts, error)
        return False
    retry_in = retry_delay(row.attempts)
    logger.info("webhook %s %s attempt %s failed (%s); next in %.1fs", row.pk, row.event, row.attempts, error,
                retry_in)
    raise WebhookFailed(f"webhook {row.pk} attempt {row.attempts}: {error}", retry_in=retry_in)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer, not a delivery: urllib would re-send a POST as
    a body-less GET. With no new request, urllib raises the 3xx as an HTTPError."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_opener = urllib.request.build_opener(_NoRedirect)


def _post(delivery: WebhookDelivery) -> tuple[int | None, str, bool]:
    """POST the delivery once: (HTTP status or None, error, whether retrying is pointless)."""
    if urlsplit(delivery.url).scheme not in ("http", "https"):
        return None, "the URL is not http:// or https://", True
    secret = Tenant.objects.filter(pk=delivery.tenant_id).values_list("webhook_secret", flat=True).first()
    if not secret:
        return None, "the delivery has no tenant whose secret could sign it", True
    body = json.dumps({"id": delivery.pk, "event": delivery.event, "created_at": delivery.created_at.isoformat(),
                       "data": delivery.payload}, separators=(",", ":")).encode()
    timestamp = int(time.time())
    request = urllib.request.Request(delivery.url, data=body, method="POST", headers={
        "Content-Type": "application/json",
        "User-Agent": "ExecGo-Webhook/1",
        EVENT_HEADER: delivery.event,
        DELIVERY_HEADER: str(delivery.pk),
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: f"sha256={sign(secret, timestamp, delivery.url, body)}",
    })
    try:
        with _opener.open(request, timeout=settings.EXECGO_WEBHOOK_TIMEOUT_S) as response:
            response.read(ERROR_CHARS)
            return response.status, "", False
    except urllib.error.HTTPError as answer:  # an answer, with a status worth recording
        try:
            text = answer.read(ERROR_CHARS).decode(errors="replace")
        except (OSError, http.client.HTTPException):
            text = ""
        return answer.code, (f"HTTP {answer.code} {answer.reason}" + (f": {text}" if text else ""))[:ERROR_CHARS], False
    except urllib.error.URLError as error:
        return None, f"{type(error.reason).__name__}: {error.reason}"[:ERROR_CHARS], False
    except (OSError, http.client.HTTPException, ValueError) as error:  # timeouts, resets, bad status lines
        return None, f"{type(error).__name__}: {error}"[:ERROR_CHARS], False


def run_callback_payload(run: Run) -> dict:
    """What a run's callback_url receives: the run's summary (its API
    representation has the rest)."""
    steps = Step.objects.filter(run_id=run.pk).order_by("position").values_list("step_id", "status", "attempt")
    return {
        "run": run.pk, "title": run.title, "state": run.state, "closing_cause": run.closing_cause,
        "finished_at": run.finished_at.isoformat() if run.finished_at else None,
        "steps": [{"id": step_id, "status": status, "attempts": attempt} for step_id, status, attempt in steps],
        "url": f"/api/v1/runs/{run.pk}",
    }
