"""Tenant-scoped reads of approval requests."""

from django.db.models import QuerySet

from approvals.models import ApprovalRequest, ApprovalStatus
from runs.selectors import tenant_of


def requests_for_user(user, *, status: str | None = None) -> QuerySet[ApprovalRequest]:
    tenant = tenant_of(user)
    if tenant is None:
        return ApprovalRequest.objects.none()
    requests = ApprovalRequest.objects.filter(tenant=tenant).select_related("run", "run__submitted_by")
    if status == "decided":
        requests = requests.exclude(status=ApprovalStatus.PENDING)
    elif status:
        requests = requests.filter(status=status)
    return requests.order_by("-id")


def request_for_user(user, request_id: int) -> ApprovalRequest | None:
    return requests_for_user(user).filter(pk=request_id).first()
