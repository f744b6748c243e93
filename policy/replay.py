"""What-if replay (docs/policy.md#what-if-replay): what a rule change would
do, before it is saved.

The changed policy (the current rules with one rule added, edited or
deleted) and the current one both rate the stored plans (the steps as
stored: edits approvers made included) of the last ``limit`` runs of a
tenant, or of every tenant for a global rule, each run under its own
tenant's rules. Every step whose risk differs is a flip (low → high,
high → deny, …), and every run whose overall risk differs is listed too.
Nothing runs and nothing is written: it is ``evaluate_policy`` twice per
run, with the rule sets given rather than read.
"""

import copy
import time
from dataclasses import dataclass, field

from django.db.models import Prefetch

from policy.evaluation import evaluate_policy
from policy.models import PolicyRule
from policy.rules import policy_rule_validate, policy_snapshot
from runs.models import Run, Step

DEFAULT_RUNS = 500
MAX_RUNS = 5000


@dataclass(frozen=True)
class RuleChange:
    """``before``: the rule as saved (None: a rule to add); ``after``: the
    rule as it would be saved (None: the rule deleted). Unsaved instances."""

    before: PolicyRule | None
    after: PolicyRule | None

    def concerns(self, tenant_id: int) -> bool:
        return any(rule is not None and rule.tenant_id in (None, tenant_id) for rule in (self.before, self.after))


@dataclass(frozen=True)
class Flip:
    run_id: int
    step_id: str | None  # None: the run's overall risk
    before: str
    after: str
    reasons: tuple[str, ...] = ()  # the step's reasons under the changed policy


@dataclass
class ReplayReport:
    runs: int = 0
    steps: int = 0
    elapsed_ms: float = 0.0
    flips: list[Flip] = field(default_factory=list)  # steps
    run_flips: list[Flip] = field(default_factory=list)  # runs

    def counts(self) -> dict[str, int]:
        """How many steps flipped each way, e.g. {"low → high": 3}."""
        counted: dict[str, int] = {}
        for flip in self.flips:
            key = f"{flip.before} → {flip.after}"
            counted[key] = counted.get(key, 0) + 1
        return counted


def changed_rules(rules: list[PolicyRule], change: RuleChange, tenant_id: int) -> list[PolicyRule]:
    """``rules`` (one tenant's, in priority order) with ``change`` applied."""
    kept = [rule for rule in rules if change.before is None or rule.pk != change.before.pk]
    after = change.after
    if after is not None and after.enabled and after.tenant_id in (None, tenant_id):
        kept.append(after)
    return sorted(kept, key=lambda rule: (rule.priority, rule.pk if rule.pk is not None else float("inf")))


def policy_replay(change: RuleChange, *, tenant_id: int | None, limit: int = DEFAULT_RUNS) -> ReplayReport:
    """Replay ``change`` over the last ``limit`` runs of ``tenant_id`` (of
    every tenant when None). Raises ValidationError for a changed rule
    that could not be saved either."""
    if change.after is not None:
        policy_rule_validate(change.after)
    limit = max(1, min(int(limit), MAX_RUNS))
    started = time.perf_counter()
    runs = Run.objects.defer(*Run.BULKY_FIELDS).order_by("-id").prefetch_related(
        Prefetch("steps", queryset=Step.objects.order_by("position")))
    if tenant_id is not None:
        runs = runs.filter(tenant_id=tenant_id)
    report, policies = ReplayReport(), {}
    for run in runs[:limit]:
        steps = list(run.steps.all()) or planned_steps(run)
        report.runs += 1
        report.steps += len(steps)
        if not steps or not change.concerns(run.tenant_id):
            continue
        if run.tenant_id not in policies:
            version, rules = policy_snapshot(run.tenant_id)
            policies[run.tenant_id] = (version, rules), (version, changed_rules(rules, change, run.tenant_id))
        now, then = policies[run.tenant_id]
        before, after = evaluate_policy(run, steps, snapshot=now), evaluate_policy(run, steps, snapshot=then)
        rows = {row["id"]: row for row in before.data["steps"]}
        for row in after.data["steps"]:
            if rows[row["id"]]["risk"] != row["risk"]:
                report.flips.append(Flip(run.pk, row["id"], rows[row["id"]]["risk"], row["risk"],
                                         tuple(row["reasons"])))
        if before.risk != after.risk:
            report.run_flips.append(Flip(run.pk, None, before.risk, after.risk))
    report.elapsed_ms = round((time.perf_counter() - started) * 1000, 1)
    return report


def planned_steps(run: Run) -> list[Step]:
    """The steps of a run that never got as far as PLANNING, from its
    stored plan (unsaved, as ``policy_dry_run`` rates a plan)."""
    plan = Run.objects.filter(pk=run.pk).values_list("plan", flat=True).first() or {}
    steps = plan.get("steps") if isinstance(plan, dict) else None
    if not isinstance(steps, list):
        return []
    return [Step(run=run, step_id=step.get("id", str(position)), position=position, tool=step.get("tool", ""),
                 params=step.get("params") or {}, depends_on=step.get("depends_on") or [],
                 timeout_s=step.get("timeout_s") or 0, retries=step.get("retries") or 0,
                 requested_plan=step.get("sandbox") or {})
            for position, step in enumerate(steps) if isinstance(step, dict)]


def rule_from(values: dict, *, base: PolicyRule | None, tenant_id: int | None) -> PolicyRule:
    """An unsaved rule: ``base`` (a saved rule, copied) with ``values``
    over it, or a new rule of ``tenant_id``. Raises ValidationError."""
    rule = copy.deepcopy(base) if base is not None else PolicyRule(tenant_id=tenant_id)
    for name, value in values.items():
        setattr(rule, name, value)
    rule.full_clean(exclude=["tenant"], validate_unique=False, validate_constraints=False)
    return rule
