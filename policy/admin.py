"""The policy's admin: its rules, changed only through ``policy.rules`` (which
validates them and bumps the policy version in the same transaction), and
the versions, read-only and the superuser's. A tenant's staff see, add,
change and delete their tenant's own rules (a new one lands in their
tenant); the global rules, which rate every tenant's runs, are the
superuser's. Rule changes are audited."""

import copy

from django import forms
from django.contrib import admin
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.http import HttpResponseNotAllowed
from django.template.response import TemplateResponse
from django.urls import path

from policy.models import PolicyRule, PolicyVersion
from policy.replay import DEFAULT_RUNS, RuleChange, policy_replay
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
        fields = ("tenant", "name", "tool", "field", "pattern", "negate", "outcome", "reason", "enabled", "priority",
                  "reminder_fractions", "escalation_after_s")
        widgets = {"tool": forms.Select(choices=[(tool, tool) for tool in (*KNOWN_TOOLS, ANY_TOOL)])}

    def clean_pattern(self) -> str:
        validate_rule_pattern(self.cleaned_data["pattern"])
        return self.cleaned_data["pattern"]

    def clean_reminder_fractions(self):
        fractions = self.cleaned_data.get("reminder_fractions")
        if fractions is not None and not (isinstance(fractions, list) and all(
                isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1
                for value in fractions)):
            raise ValidationError("a list of fractions between 0 and 1, e.g. [0.5, 0.9]")
        return fractions

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

    change_form_template = "admin/policy/policyrule/change_form.html"

    def changeform_view(self, request, object_id=None, form_url="", extra_context=None):
        return super().changeform_view(request, object_id, form_url,
                                       {**(extra_context or {}), "replay_runs": DEFAULT_RUNS})

    def get_urls(self):
        preview = self.admin_site.admin_view(self.preview_view)
        return [path("preview/", preview, name="policy_policyrule_preview_new"),
                path("<path:object_id>/preview/", preview, name="policy_policyrule_preview"),
                *super().get_urls()]

    def preview_view(self, request, object_id=None):
        """The form's "preview": the rule as it stands in the form, replayed
        over stored plans (``policy.replay``); nothing is saved. A tenant's
        staff replay over their tenant's runs, the superuser over the rule's
        tenant's, or every tenant's for a global rule."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        original = self.get_object(request, object_id) if object_id is not None else None  # 404 out of scope
        allowed = self.has_change_permission(request, original) if original else self.has_add_permission(request)
        if not allowed:
            raise PermissionDenied
        form = self.get_form(request, original, change=original is not None)(
            request.POST, instance=copy.deepcopy(original) if original else None)
        context = {**self.admin_site.each_context(request), "opts": self.opts, "original": original,
                   "title": "What this change would do"}
        if not form.is_valid():
            return TemplateResponse(request, "admin/policy/policyrule/preview.html",
                                    {**context, "errors": form.errors})
        after = form.save(commit=False)
        if original is None and not is_operator(request):
            after.tenant_id = staff_tenant_id(request)
        scope = after.tenant_id if is_operator(request) else staff_tenant_id(request)
        report = policy_replay(RuleChange(before=original, after=after), tenant_id=scope)
        return TemplateResponse(request, "admin/policy/policyrule/preview.html", {
            **context, "report": report, "rule_name": after.name,
            "scope": after.tenant if scope is not None else None})

    def delete_model(self, request, obj):
        policy_rule_delete(obj)

    def delete_queryset(self, request, queryset):
        with transaction.atomic():
            for rule in queryset:
                policy_rule_delete(rule)


@admin.register(PolicyVersion)
class PolicyVersionAdmin(SuperuserOnlyAdmin, ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ("version", "updated_at")
