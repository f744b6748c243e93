"""Approval requests in the admin: read-only records, and the one write,
"Approve" / "Reject selected requests", through the same decision service
as the pages and the API (same rules: approvers of the tenant, never the
submitter)."""

from django.contrib import admin, messages

from approvals.models import ApprovalRequest, Decision
from approvals.services import approval_decide
from runs.admin_scope import TenantScopedAdmin
from runs.errors import ExecGoError
from runtime.admin import PrettyJSONMixin


class DecisionInline(admin.TabularInline):
    model = Decision
    extra = 0
    can_delete = False
    fields = readonly_fields = ("decider", "decision", "comment", "decided_at")

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(ApprovalRequest)
class ApprovalRequestAdmin(TenantScopedAdmin, PrettyJSONMixin, admin.ModelAdmin):
    tenant_path = "tenant"

    list_display = ("id", "run", "tenant", "status", "risk", "approvals_required", "requested_at", "expires_at",
                    "decided_at")
    list_select_related = ("run", "tenant")
    list_filter = ("status", "risk", "tenant", "requested_at")
    search_fields = ("id__exact", "run__id__exact", "run__title")
    inlines = (DecisionInline,)
    actions = ("approve_selected", "reject_selected")

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def _decide(self, request, queryset, *, approve: bool) -> None:
        for approval in queryset.select_related("run"):
            try:
                outcome = approval_decide(request=approval, actor=request.user, approve=approve,
                                          comment="decided in the admin")
            except ExecGoError as exc:
                self.message_user(request, f"request {approval.pk}: {exc.envelope['message']}", messages.ERROR)
            else:
                self.message_user(request, f"request {approval.pk}: {outcome.request.status}", messages.SUCCESS)

    @admin.action(description="Approve selected requests", permissions=["view"])
    def approve_selected(self, request, queryset):
        self._decide(request, queryset, approve=True)

    @admin.action(description="Reject selected requests", permissions=["view"])
    def reject_selected(self, request, queryset):
        self._decide(request, queryset, approve=False)
