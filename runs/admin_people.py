"""The people's admin: tenants (and their webhook secret), memberships, and
Django's users and groups registered again, each tenant-scoped or
superuser-only (``runs.admin_scope``) and every change audited
(``runs.admin_audit``)."""

from django.contrib import admin, messages
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group, User
from django.db.models import Q
from django.utils.html import format_html

from approvals.models import AGENTS_GROUP, APPROVERS_GROUP
from runs.admin_audit import AuditedAdminMixin, AuditedUserAdminMixin
from runs.admin_scope import SuperuserOnlyAdmin, TenantScopedAdmin, is_operator, staff_tenant_id
from runs.models import Membership, Tenant
from runs.webhooks import webhook_secret_rotate


@admin.register(Tenant)
class TenantAdmin(AuditedAdminMixin, TenantScopedAdmin, admin.ModelAdmin):
    """A tenant's staff see (and may rename) their own tenant, read its
    webhook secret and rotate it; tenants come and go with the operator."""

    tenant_path = "pk"
    audit_secret_fields = frozenset({"webhook_secret"})

    list_display = ("name", "id", "created_at")
    ordering = ("name",)  # autocomplete pages through it
    search_fields = ("name",)
    list_filter = ("created_at",)
    readonly_fields = ("created_at", "webhook_signing_secret")
    actions = ("rotate_webhook_secret",)

    def audit_tenant_ids(self, obj, before, after):
        return [obj.pk]

    @admin.display(description="webhook secret")
    def webhook_signing_secret(self, tenant: Tenant):
        # Only on the tenant's own change page, which only its staff and the
        # operator can open (tenant_path); never in the list.
        return format_html("<code>{}</code>", tenant.webhook_secret) if tenant.pk else "generated on save"

    def has_rotate_permission(self, request) -> bool:
        return self.has_change_permission(request)

    @admin.action(description="Rotate webhook secret", permissions=["rotate"])
    def rotate_webhook_secret(self, request, queryset):
        rotated = []
        for tenant in queryset.order_by("pk"):
            webhook_secret_rotate(tenant=tenant, actor=request.user)
            rotated.append(tenant.name)
        self.message_user(request, f"New webhook secret for {', '.join(rotated)}: every delivery attempt from now on is signed with it.",
                          messages.SUCCESS)

    def has_add_permission(self, request) -> bool:
        return is_operator(request)

    def has_delete_permission(self, request, obj=None) -> bool:
        return is_operator(request)


@admin.register(Membership)
class MembershipAdmin(AuditedAdminMixin, TenantScopedAdmin, admin.ModelAdmin):
    """Putting a user in a tenant, or moving one out, is the operator's:
    a tenant's staff only see who is in theirs."""

    tenant_path = "tenant"

    list_display = ("user", "tenant")
    list_select_related = ("user", "tenant")
    search_fields = ("user__username", "user__email", "tenant__name")
    list_filter = ("tenant",)
    autocomplete_fields = ("user", "tenant")

    def has_add_permission(self, request) -> bool:
        return is_operator(request)

    def has_change_permission(self, request, obj=None) -> bool:
        return is_operator(request)

    def has_delete_permission(self, request, obj=None) -> bool:
        return is_operator(request)


admin.site.unregister(User)


@admin.register(User)
class TenantUserAdmin(AuditedUserAdminMixin, TenantScopedAdmin, UserAdmin):
    """A tenant's staff manage their tenant's users, never a superuser (the
    operator's account, whose password would be the whole installation), and
    never grant superuser status, permissions one by one or a group other
    than the tenant roles; a user they add joins their tenant."""

    tenant_path = "membership__tenant"

    def get_queryset(self, request):
        users = super().get_queryset(request)
        return users if is_operator(request) else users.filter(is_superuser=False)

    def get_readonly_fields(self, request, obj=None):
        fields = tuple(super().get_readonly_fields(request, obj))
        return fields if is_operator(request) else (*fields, "is_superuser", "user_permissions")

    def get_form(self, request, obj=None, **kwargs):
        form = super().get_form(request, obj, **kwargs)
        if not is_operator(request) and "groups" in form.base_fields:
            # The roles that mean something inside a tenant, and the groups
            # the user already has (which stay removable); any other group is
            # the operator's to hand out, and its name none of the tenant's business.
            held = Q(user=obj) if obj is not None else Q(pk__in=[])
            form.base_fields["groups"].queryset = Group.objects.filter(
                Q(name__in=[AGENTS_GROUP, APPROVERS_GROUP]) | held).distinct().order_by("name")
        return form

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        if not change and not is_operator(request):
            Membership.objects.create(user=obj, tenant_id=staff_tenant_id(request))


admin.site.unregister(Group)


@admin.register(Group)
class AuditedGroupAdmin(SuperuserOnlyAdmin, AuditedAdminMixin, GroupAdmin):
    """Groups (the roles and their permissions) are the operator's."""
