"""The policy's rules and their version.

Both tables keep the names they had when the policy lived in the ``runs``
app (``policy/migrations/0001_initial.py`` moved the models, not the rows)."""

from django.db import models


class RiskLevel(models.TextChoices):
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"
    DENY = "deny"


class PolicyRule(models.Model):
    """Matches a tool call to a risk. Changed only through
    ``policy.rules.policy_rule_save`` / ``policy_rule_delete``, which bump the
    policy version in the same transaction. A rule of a tenant rates that
    tenant's runs only; a global one (no tenant: the operator's) every
    tenant's (docs/policy.md#per-tenant-rules)."""

    class Field(models.TextChoices):
        ARGV = "argv"  # the shell command line, argv joined by spaces
        SCRIPT = "script"
        COMMAND = "command"  # argv or script, whichever the step has
        # Each simple command of the parsed argv or script (policy.shell_words):
        # normalised words, then redirections; and each pipeline as "a | b".
        WORDS = "words"
        URL = "url"
        METHOD = "method"
        PATH = "path"
        OP = "op"

    tenant = models.ForeignKey("runs.Tenant", null=True, blank=True, on_delete=models.CASCADE,
                               related_name="policy_rules", help_text="empty: a global rule, for every tenant")
    name = models.CharField(max_length=100)
    tool = models.CharField(max_length=20, help_text="shell, http, file, or * for any tool")
    field = models.CharField(max_length=10, choices=Field.choices)
    pattern = models.CharField(max_length=500, help_text=(
        "a Python regular expression, searched in the field (for words: in each parsed simple command and "
        "each pipeline; it matches when it is found in any of them)"))
    negate = models.BooleanField(default=False, help_text="match when the pattern is NOT found")
    outcome = models.CharField(max_length=10, choices=RiskLevel.choices)
    reason = models.CharField(max_length=300)
    enabled = models.BooleanField(default=True)
    priority = models.IntegerField(default=100, help_text="lower runs first; listed in this order in traces")
    approvals_required = models.PositiveSmallIntegerField(
        default=1, help_text="distinct approvers a run needs when this rule rates it high (N of the approvers)")
    # When the request this rule's high rating opens reminds and escalates (approvals.reminders); empty: the tenant's.
    reminder_fractions = models.JSONField(
        null=True, blank=True, help_text="fractions of the request's time to remind approvers at, e.g. [0.5, 0.9] "
                                         "(empty: the tenant's)")
    escalation_after_s = models.PositiveIntegerField(
        null=True, blank=True, help_text="seconds until the tenant's escalation group is told (empty: the tenant's; "
                                         "0: never)")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "runs_policyrule"
        ordering = ["priority", "id"]
        constraints = [
            models.UniqueConstraint(fields=["name"], condition=models.Q(tenant__isnull=True),
                                    name="policy_rule_global_name_unique"),
            models.UniqueConstraint(fields=["tenant", "name"], name="policy_rule_tenant_name_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.outcome})"


class PolicyVersion(models.Model):
    """A single row: the global rules' version, bumped on every change of a
    global rule (``policy.rules``)."""

    version = models.PositiveIntegerField(default=1)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "runs_policyversion"

    def __str__(self) -> str:
        return f"policy v{self.version}"


class TenantPolicyVersion(models.Model):
    """The version of a tenant's policy (the global rules and its own), for
    a tenant whose own rules changed; else the global version is the
    tenant's. A global change moves every row, a tenant's change its row
    only (``policy.rules``). Keyed by the tenant: no sequence to share."""

    tenant = models.OneToOneField("runs.Tenant", primary_key=True, on_delete=models.CASCADE,
                                  related_name="policy_version")
    version = models.PositiveIntegerField()
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"policy v{self.version} of tenant {self.tenant_id}"
