"""Rule changes: a rule is validated when saved, and every change moves the
policy version in its own transaction (docs/policy.md, "Policy version")."""

import re

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from policy.models import PolicyRule, PolicyVersion
from runs.plan_schema import KNOWN_TOOLS

ANY_TOOL = "*"
Field = PolicyRule.Field
FIELDS_OF_TOOL = {
    "shell": {Field.ARGV, Field.SCRIPT, Field.COMMAND, Field.WORDS},
    "http": {Field.URL, Field.METHOD},
    "file": {Field.PATH, Field.OP},
}
MAX_SNAPSHOT_ATTEMPTS = 5


def current_policy_version() -> int:
    return PolicyVersion.objects.get_or_create(pk=1)[0].version


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


def _bump_policy_version() -> None:
    PolicyVersion.objects.get_or_create(pk=1)
    PolicyVersion.objects.filter(pk=1).update(version=F("version") + 1, updated_at=timezone.now())


def policy_rule_save(rule: PolicyRule) -> PolicyRule:
    """Create or change a rule; the policy version moves with it or not at all.
    Raises ValidationError (keyed by field) for a rule that cannot work."""
    errors: dict[str, list] = {}
    for check in (rule.full_clean, lambda: policy_rule_validate(rule)):
        try:
            check()
        except ValidationError as exc:
            errors = exc.update_error_dict(errors)
    if errors:
        raise ValidationError(errors)
    with transaction.atomic():
        rule.save()
        _bump_policy_version()
    return rule


def policy_rule_delete(rule: PolicyRule) -> None:
    with transaction.atomic():
        rule.delete()
        _bump_policy_version()


def policy_snapshot() -> tuple[int, list[PolicyRule]]:
    """The enabled rules and the version they belong to.

    Every rule change bumps the version in its own transaction, so a version
    read before and after the rules that did not move proves the rules are
    that version's (read committed gives each query its own snapshot).
    """
    for _attempt in range(MAX_SNAPSHOT_ATTEMPTS):
        version = current_policy_version()
        rules = list(PolicyRule.objects.filter(enabled=True).order_by("priority", "id"))
        if current_policy_version() == version:
            return version, rules
    raise RuntimeError(f"policy rules changed during {MAX_SNAPSHOT_ATTEMPTS} reads in a row")
