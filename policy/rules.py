"""Rule changes: a rule is validated when saved, and every change moves the
policy version in its own transaction (docs/policy.md, "Policy version").

Versions are per tenant (docs/policy.md#per-tenant-rules): a change of a
global rule moves every tenant's version, a change of a tenant's rule moves
that tenant's only, so it voids only that tenant's pending approvals.
"""

import re

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import F, Q, Subquery
from django.db.models.functions import Coalesce
from django.utils import timezone

from policy.models import PolicyRule, PolicyVersion, TenantPolicyVersion
from runs.plan_schema import KNOWN_TOOLS

ANY_TOOL = "*"
Field = PolicyRule.Field
FIELDS_OF_TOOL = {
    "shell": {Field.ARGV, Field.SCRIPT, Field.COMMAND, Field.WORDS},
    "http": {Field.URL, Field.METHOD},
    "file": {Field.PATH, Field.OP},
}
MAX_SNAPSHOT_ATTEMPTS = 5


GLOBAL_VERSION = 1  # the pk of the global rules' version row


def current_policy_version(tenant_id: int | None = None) -> int:
    """The version of the policy that rates ``tenant_id``'s runs (the
    global rules and its own); of the global rules alone for None."""
    version = _effective_version(tenant_id)
    if version is None:  # no global row yet (a new database): made here, as every rule change makes it first
        PolicyVersion.objects.get_or_create(pk=GLOBAL_VERSION)
        version = _effective_version(tenant_id)
    return version


def _effective_version(tenant_id: int | None) -> int | None:
    """One query: the tenant's own version where it has one, else the
    global one; None while the global row does not exist."""
    rows = PolicyVersion.objects.filter(pk=GLOBAL_VERSION)
    if tenant_id is None:
        return rows.values_list("version", flat=True).first()
    own = TenantPolicyVersion.objects.filter(tenant_id=tenant_id).values("version")[:1]
    return rows.annotate(effective=Coalesce(Subquery(own), F("version"))).values_list("effective", flat=True).first()


def _version_of(tenant_id: int | None):
    """``_effective_version`` as an expression, to read with other rows."""
    version = Subquery(PolicyVersion.objects.filter(pk=GLOBAL_VERSION).values("version")[:1])
    if tenant_id is None:
        return version
    return Coalesce(Subquery(TenantPolicyVersion.objects.filter(tenant_id=tenant_id).values("version")[:1]), version)


def validate_rule_pattern(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValidationError(f"not a valid regular expression: {exc}", code="invalid_pattern") from None


def validate_rule_tool(tool: str) -> str:
    if tool != ANY_TOOL and tool not in KNOWN_TOOLS:
        raise ValidationError(f"tool must be one of {', '.join(KNOWN_TOOLS)} or {ANY_TOOL}, not {tool!r}",
                              code="invalid_tool")
    return tool


def validate_rule_field(tool: str, field: str) -> None:
    """A rule on a field its tool never has would silently match nothing."""
    if tool in FIELDS_OF_TOOL and field not in FIELDS_OF_TOOL[tool]:
        names = ", ".join(sorted(FIELDS_OF_TOOL[tool]))
        raise ValidationError(f"{tool} steps have no {field!r} field (they have {names})", code="invalid_field")


def policy_rule_validate(rule: PolicyRule) -> None:
    """Raise a ValidationError keyed by field for a rule that cannot work."""
    errors: dict[str, list[ValidationError]] = {}
    for field, check in (("pattern", lambda: validate_rule_pattern(rule.pattern)),
                         ("tool", lambda: validate_rule_tool(rule.tool)),
                         ("field", lambda: validate_rule_field(rule.tool, rule.field))):
        try:
            check()
        except ValidationError as exc:
            errors.setdefault(field, []).append(exc)
    if errors:
        raise ValidationError(errors)


def _validate_name_free(rule: PolicyRule) -> None:
    """Names are unique among the global rules and within a tenant (the
    table's constraints back this up)."""
    same = PolicyRule.objects.filter(name=rule.name, tenant_id=rule.tenant_id).exclude(pk=rule.pk)
    if same.exists():
        where = "among the global rules" if rule.tenant_id is None else "in this tenant"
        raise ValidationError({"name": [f"a rule of this name exists already {where}"]}, code="unique")


def _bump_policy_version(tenant_id: int | None) -> None:
    """In the caller's transaction. The global row is locked first by every
    change, so a tenant's row is created from the global version as it is
    (never one a concurrent global change is moving) and versions never
    move back."""
    PolicyVersion.objects.get_or_create(pk=GLOBAL_VERSION)
    global_row = PolicyVersion.objects.select_for_update().get(pk=GLOBAL_VERSION)
    now = timezone.now()
    if tenant_id is None:
        PolicyVersion.objects.filter(pk=GLOBAL_VERSION).update(version=F("version") + 1, updated_at=now)
        TenantPolicyVersion.objects.update(version=F("version") + 1, updated_at=now)  # every tenant's moves too
        return
    TenantPolicyVersion.objects.get_or_create(tenant_id=tenant_id, defaults={"version": global_row.version})
    TenantPolicyVersion.objects.filter(tenant_id=tenant_id).update(version=F("version") + 1, updated_at=now)


def policy_rule_save(rule: PolicyRule) -> PolicyRule:
    """Create or change a rule; the policy version moves with it or not at all.
    Raises ValidationError (keyed by field) for a rule that cannot work."""
    errors: dict[str, list] = {}
    for check in (lambda: rule.full_clean(validate_constraints=False), lambda: policy_rule_validate(rule),
                  lambda: _validate_name_free(rule)):
        try:
            check()
        except ValidationError as exc:
            errors = exc.update_error_dict(errors)
    if errors:
        raise ValidationError(errors)
    with transaction.atomic():
        if rule.pk is not None:  # a rule moved from one tenant (or global) to another changes both policies
            before = PolicyRule.objects.filter(pk=rule.pk).values_list("tenant_id", flat=True).first()
            if before != rule.tenant_id:
                _bump_policy_version(before)
        rule.save()
        _bump_policy_version(rule.tenant_id)
    return rule


def policy_rule_delete(rule: PolicyRule) -> None:
    with transaction.atomic():
        rule.delete()
        _bump_policy_version(rule.tenant_id)


def policy_snapshot(tenant_id: int | None = None) -> tuple[int, list[PolicyRule]]:
    """The enabled rules that rate ``tenant_id``'s runs (the global ones and
    its own) and the version they belong to.

    One statement reads both where there is a rule: every rule row carries
    the version, and one statement reads one snapshot. Otherwise the version
    is read before and after the rules: every rule change bumps it in its
    own transaction, so a version that did not move proves the rules are
    that version's (read committed gives each query its own snapshot).
    """
    enabled = PolicyRule.objects.filter(Q(tenant__isnull=True) | Q(tenant_id=tenant_id), enabled=True)
    rules = list(enabled.annotate(policy_version=_version_of(tenant_id)).order_by("priority", "id"))
    if rules and rules[0].policy_version is not None:
        return rules[0].policy_version, rules
    for _attempt in range(MAX_SNAPSHOT_ATTEMPTS):
        version = current_policy_version(tenant_id)
        rules = list(enabled.order_by("priority", "id"))
        if current_policy_version(tenant_id) == version:
            return version, rules
    raise RuntimeError(f"policy rules changed during {MAX_SNAPSHOT_ATTEMPTS} reads in a row")
