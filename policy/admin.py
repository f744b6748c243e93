"""The policy's admin: its rules, changed only through ``policy.rules`` (which
validates them and bumps the policy version in the same transaction), and
the versions, read-only and the superuser's. A tenant's staff see, add,
change and delete their tenant's own rules (a new one lands in their
tenant); the global rules, which rate every tenant's runs, are the
superuser's. Rule changes are audited."""

from django import forms
from django.contrib import admin
from django.core.exceptions import ValidationError
from django.db import transaction

from policy.models import PolicyRule, PolicyVersion
from policy.rules import (
    ANY_TOOL,
    policy_rule_delete,
    policy_rule_save,
    validate_rule_field,
    validate_rule_pattern,
    validate_rule_tool,
)
from runs.admin_audit import AuditedAdminMixin
from runs.admin_scope import ReadOnlyAdminMixin, SuperuserOnlyAdmin, TenantScopedAdmin, is_operator, staff_tenant_id
from runs.plan_schema import KNOWN_TOOLS


class PolicyRuleForm(forms.ModelForm):
    """Shows a rule that cannot work (bad regex, unknown tool, a field its tool
    never has) as form errors; the checks are the save service's own."""

    staff_tenant_id: int | None = None  # set for a tenant's staff, whose form has no tenant field

    class Meta:
        model = PolicyRule
        fields = ("tenant", "name", "tool", "field", "pattern", "negate", "outcome", "reason", "enabled", "priority")
        widgets = {"tool": forms.Select(choices=[(tool, tool) for tool in (*KNOWN_TOOLS, ANY_TOOL)])}

    def clean_pattern(self) -> str:
        validate_rule_pattern(self.cleaned_data["pattern"])
        return self.cleaned_data["pattern"]

    def clean_tool(self) -> str:
        return validate_rule_tool(self.cleaned_data["tool"])

    def clean(self):
        cleaned = super().clean()
        if "tool" in cleaned and "field" in cleaned:
            try:
                validate_rule_field(cleaned["tool"], cleaned["field"])
            except ValidationError as exc:
                self.add_error("field", exc)
        if "name" in cleaned:
            tenant_id = self._tenant_id(cleaned)
            if PolicyRule.objects.filter(name=cleaned["name"], tenant_id=tenant_id).exclude(
                    pk=self.instance.pk).exists():
                where = "among the global rules" if tenant_id is None else "in this tenant"
                self.add_error("name", f"a rule of this name exists already {where}")
        return cleaned

    def _tenant_id(self, cleaned) -> int | None:
        if "tenant" in self.fields:
            return cleaned["tenant"].pk if cleaned.get("tenant") else None
        return self.instance.tenant_id if self.instance.pk else self.staff_tenant_id


@admin.register(PolicyRule)
class PolicyRuleAdmin(TenantScopedAdmin, AuditedAdminMixin, admin.ModelAdmin):
    """Every change goes through policy.rules, which bumps the policy version
    in the same transaction, so a PolicyDecisionTrace names the rules it saw."""

    tenant_path = "tenant"
    form = PolicyRuleForm
    list_display = ("name", "tenant", "tool", "field", "pattern", "negate", "outcome", "enabled", "priority",
                    "updated_at")
    list_editable = ("enabled", "priority")
    list_filter = ("outcome", "tool", "enabled", "field")
    search_fields = ("name", "pattern", "reason")
    ordering = ("priority", "id")
    readonly_fields = ("updated_at",)

    def get_list_display(self, request):
        shown = super().get_list_display(request)
        return shown if is_operator(request) else tuple(name for name in shown if name != "tenant")

    def get_fields(self, request, obj=None):
        fields = super().get_fields(request, obj)
        return fields if is_operator(request) else [name for name in fields if name != "tenant"]

    def get_form(self, request, obj=None, change=False, **kwargs):
        form = super().get_form(request, obj, change, **kwargs)
        if not is_operator(request):
            form = type(form.__name__, (form,), {"staff_tenant_id": staff_tenant_id(request)})
        return form

    def get_list_filter(self, request):
        filters = super().get_list_filter(request)
        return (*filters, "tenant") if is_operator(request) else filters

    def save_model(self, request, obj, form, change):
        if not change and not is_operator(request):
            obj.tenant_id = staff_tenant_id(request)
        policy_rule_save(obj)

    def delete_model(self, request, obj):
        policy_rule_delete(obj)

    def delete_queryset(self, request, queryset):
        with transaction.atomic():
            for rule in queryset:
                policy_rule_delete(rule)


@admin.register(PolicyVersion)
class PolicyVersionAdmin(SuperuserOnlyAdmin, ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ("version", "updated_at")
