"""Celery tasks of the approvals: ids in, one service call."""

from celery import shared_task
from django.utils import timezone

from approvals.models import ApprovalRequest, ApprovalStatus
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
