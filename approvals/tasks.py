"""Celery tasks of the approvals: ids in, one service call."""

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from approvals.models import ApprovalRequest, ApprovalStatus, Notification
from approvals.notify import SendFailed, notification_send, pending_notifications, retry_delay
from approvals.reminders import remind_and_escalate
from approvals.services import approval_expire


@shared_task(bind=True, acks_late=True, ignore_result=True)
def expire_approval_request(self, request_id: int) -> None:
    """Sent with ``eta=expires_at`` when the request is made; the sweeper is
    the fallback when this message is lost."""
    if approval_expire(request_id) or self.request.is_eager:
        return  # eager (tests, CELERY_TASK_ALWAYS_EAGER) ignores eta: only the sweeper can expire it then
    request = ApprovalRequest.objects.filter(pk=request_id, status=ApprovalStatus.PENDING).first()
    if request is not None and timezone.now() < request.expires_at:
        # Delivered early (another host's clock): wait for the real moment.
        expire_approval_request.apply_async((request_id,), eta=request.expires_at)


@shared_task(bind=True, acks_late=True, ignore_result=True)
def send_notification(self, notification_id: int) -> None:
    """One attempt at an approvers' notification; a failed one is sent
    again after a backoff until its row says failed."""
    try:
        notification_send(notification_id)
    except SendFailed:
        attempts = Notification.objects.filter(pk=notification_id).values_list("attempts", flat=True).first() or 1
        send_notification.apply_async((notification_id,), countdown=retry_delay(attempts))


@shared_task(ignore_result=True)
def relay_notifications() -> int:
    """Beat: send again the notifications still pending a while after they
    were made (their message died with a broker or a worker)."""
    rows = list(pending_notifications(older_than_s=settings.EXECGO_NOTIFY_RELAY_AFTER_S).values_list("pk", flat=True))
    for notification_id in rows:
        send_notification.delay(notification_id)
    return len(rows)


@shared_task(ignore_result=True)
def send_reminders() -> dict:
    """Beat: the reminders and escalations due (approvals.reminders)."""
    return remind_and_escalate()
