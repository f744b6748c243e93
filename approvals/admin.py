"""Approval requests in the admin: read-only records, and the one write,
"Approve" / "Reject selected requests", through the same decision service
as the pages and the API (same rules: approvers of the tenant, never the
submitter, and a decision names the digest of the plan its approver saw:
the action first shows the selected requests' steps)."""

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.template.response import TemplateResponse

from approvals.models import ApprovalRequest, Decision, Notification, StandingGrant
from approvals.services import approval_decide
from runs.admin_scope import ReadOnlyAdminMixin, TenantScopedAdmin
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

    def _decide(self, request, queryset, *, approve: bool, action: str):
        """First a confirmation page showing each selected request's steps,
        which carries the digest of what it shows; its POST then decides
        each request on that digest (a request edited meanwhile is refused
        as stale, one by one)."""
        approvals = list(queryset.select_related("run"))
        if request.POST.get("confirmed") != "yes":
            return TemplateResponse(request, "admin/approvals/confirm_decision.html", {
                **self.admin_site.each_context(request), "opts": self.model._meta, "approvals": approvals,
                "approve": approve, "action": action, "title": f"{'Approve' if approve else 'Reject'} "
                                                                f"{len(approvals)} request(s)?",
                "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME})
        comment = request.POST.get("comment", "").strip()[:2000]
        for approval in approvals:
            try:
                outcome = approval_decide(request=approval, actor=request.user, approve=approve,
                                          digest=request.POST.get(f"digest-{approval.pk}", ""),
                                          comment=comment or ("decided in the admin" if approve else ""))
            except ExecGoError as exc:
                self.message_user(request, f"request {approval.pk}: {exc.envelope['message']}", messages.ERROR)
            else:
                self.message_user(request, f"request {approval.pk}: {outcome.request.status}", messages.SUCCESS)
        return None

    @admin.action(description="Approve selected requests", permissions=["view"])
    def approve_selected(self, request, queryset):
        return self._decide(request, queryset, approve=True, action="approve_selected")

    @admin.action(description="Reject selected requests", permissions=["view"])
    def reject_selected(self, request, queryset):
        return self._decide(request, queryset, approve=False, action="reject_selected")


@admin.register(Notification)
class NotificationAdmin(TenantScopedAdmin, ReadOnlyAdminMixin, admin.ModelAdmin):
    """Written and updated only by approvals.notify (the message, then each
    attempt); an operator reads who was told what, and why a message failed.
    The bodies hold no decision link (it is added when each is sent)."""

    tenant_path = "tenant"
    list_display = ("id", "kind", "channel", "recipient", "request", "status", "attempts", "created_at", "sent_at")
    list_select_related = ("recipient", "request")
    list_filter = ("status", "kind", "channel", "created_at")
    search_fields = ("request__id__exact", "recipient__username")
    exclude = ("link",)
    show_full_result_count = False


@admin.register(StandingGrant)
class StandingGrantAdmin(TenantScopedAdmin, ReadOnlyAdminMixin, admin.ModelAdmin):
    """Given with approvals and revoked on the approvers' pages
    (approvals.grants); read here."""

    tenant_path = "tenant"
    list_display = ("id", "agent", "granted_by", "request", "granted_at", "expires_at", "revoked_at", "uses")
    list_select_related = ("agent", "granted_by", "request")
    list_filter = ("granted_at", "expires_at")
    search_fields = ("agent__username", "request__id__exact")
