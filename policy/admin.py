"""The policy's admin: its rules, changed only through ``policy.rules`` (which
validates them and bumps the policy version in the same transaction), and
the version, read-only. One policy rates every tenant's runs: it is the
operator's, so both are superuser-only; rule changes are audited."""

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
from runs.admin_scope import ReadOnlyAdminMixin, SuperuserOnlyAdmin
from runs.plan_schema import KNOWN_TOOLS


class PolicyRuleForm(forms.ModelForm):
    """Shows a rule that cannot work (bad regex, unknown tool, a field its tool
    never has) as form errors; the checks are the save service's own."""

    class Meta:
        model = PolicyRule
        fields = ("name", "tool", "field", "pattern", "negate", "outcome", "reason", "enabled", "priority")
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
        return cleaned


@admin.register(PolicyRule)
class PolicyRuleAdmin(SuperuserOnlyAdmin, AuditedAdminMixin, admin.ModelAdmin):
    """Every change goes through policy.rules, which bumps the policy version
    in the same transaction, so a PolicyDecisionTrace names the rules it saw."""

    form = PolicyRuleForm
    list_display = ("name", "tool", "field", "pattern", "negate", "outcome", "enabled", "priority", "updated_at")
    list_editable = ("enabled", "priority")
    list_filter = ("outcome", "tool", "enabled", "field")
    search_fields = ("name", "pattern", "reason")
    ordering = ("priority", "id")
    readonly_fields = ("updated_at",)

    def save_model(self, request, obj, form, change):
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
