"""What every page's layout shows: the user's tenant and, for approvers,
how many runs wait for a human."""

from django.urls import reverse

from approvals.models import APPROVERS_GROUP, ApprovalRequest, ApprovalStatus
from runs.selectors import tenant_of


def navigation(request) -> dict:
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    tenant = tenant_of(user)
    is_approver = tenant is not None and user.groups.filter(name=APPROVERS_GROUP).exists()
    pending = (ApprovalRequest.objects.filter(tenant=tenant, status=ApprovalStatus.PENDING).count()
               if is_approver else 0)
    return {"execgo_nav": {
        "tenant": tenant, "is_approver": is_approver, "pending_approvals": pending,
        "approvals_url": reverse("approvals:inbox"),
    }}
