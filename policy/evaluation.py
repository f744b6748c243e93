"""POLICY_CHECK: rate every tool call of a plan against the policy rules and
the run budgets (the rules' changes are in ``policy.rules``).

A shell step's risk starts from what it can touch — its effective execution
plan (``runs.dataplane.resolve_step_plan``), its *capability baseline*:

- ``linux_sandbox`` with network ``none``/``loopback``, only the workspace
  writable and a non-root uid: low;
- the ``process`` profile in the shim's own namespaces, or ``linux_sandbox``
  without its seccomp filter (``plan["seccomp"] is False``, an adaptive
  downgrade): at least medium. Both keep the command off the data directory,
  the host's network and setuid programs, but leave it every system call of
  the kernel (keyrings, bpf, userfaultfd, io_uring, new user namespaces: the
  usual first step of a kernel exploit), and the process profile runs in the
  host's user namespace on a root that is writable wherever file modes let
  its uid write. Not high: no human needs to read a step that a bug in the
  kernel would be needed to get out of; not low: that is all it would take;
- network ``internet`` (a NAT'd namespace: it cannot reach the host's
  loopback, but nothing proves it keeps off the host's other addresses),
  network ``host``, filesystem ``host``, no sandbox, or root (uid 0, or the
  worker's own uid when the worker is root): high;
- no process limit, or host paths added to its view
  (``EXECGO_SANDBOX_READONLY_PATHS``, named in the reason): at least medium;
- a plan that cannot be resolved here (a strict request this host cannot
  honour): high, since nothing says what it can reach.

Then the parsed command (``policy.shell_words``) adds its *signals*: a command
the parser cannot resolve (a variable or substitution as the command word,
quoting that splits it, ``eval``/``exec``/``source``, a program read from a
pipe or a here-document) and inline interpreter code (``python -c``) are at
least medium. http and file steps have no baseline (file steps run in the
worker: their rules say what they may touch).

A rule matches a step when its ``tool`` is the step's tool (or ``*``) and its
``pattern`` is found (``re.search``) in the rule's ``field`` of the step — or
is not found, for a ``negate`` rule. The ``words`` field is a list: each
simple command of the parsed command and each pipeline's command names; a
rule on it matches when its pattern is found in any of them (a negated one:
in none). A field the step does not have (a URL on a shell step, a script on
an argv step) matches nothing, negated or not. Rules only raise: a step's
risk is the highest of its baseline, its signals and the outcomes of the
rules it matches (low < medium < high < deny); an http or file step no rule
matches is low. The run's risk is the highest of its steps'. A run over any
budget is denied whatever its rules say.

An http step whose destination is internal (runtime/egress.py: loopback,
private, link-local, metadata, … in any spelling, or a name that resolves
to one) is denied, or high when ``EXECGO_HTTP_ALLOWED_NETWORKS`` lists it;
the worker checks every hop again when it runs.

Hosts in ``EXECGO_HTTP_ALLOWED_HOSTS`` may receive state-changing requests
without approval: on an http step to such a host, the rules on the ``method``
field whose outcome is below ``deny`` are waived (the waiver is listed in the
step's reasons). A deny rule always applies.

Budgets (settings, with defaults):

- ``EXECGO_BUDGET_MAX_STEPS`` (100): steps in the plan;
- ``EXECGO_BUDGET_MAX_RUN_SECONDS`` (3600): the run's own timeout;
- ``EXECGO_BUDGET_MAX_CPU_SECONDS`` (600): an upper bound on the CPU the shell
  steps can use. Per step: its declared ``cpu_seconds`` limit (enforced by
  RLIMIT_CPU) or else its timeout, times its attempts, capped by the run
  timeout. For the run: the sum over steps, but never more than the run
  timeout times the plan's width (steps at one dependency depth can run at
  once; the harness stops everything at the run's deadline) — so a long
  sequential plan is not charged 40 timeouts it can never use;
- ``EXECGO_BUDGET_MAX_HTTP_CALLS`` (50): http requests, counting retries;
- ``EXECGO_BUDGET_MAX_COMMAND_CHARS`` (8192): the longest text a rule is
  matched against (command, URL, path). Regular expressions can take time
  superlinear in their input, so a step over it is not rated at all and the
  run is rejected instead.
"""

from dataclasses import dataclass, field

from django.conf import settings
from django.core.exceptions import ValidationError

from policy.baseline import RISK_ORDER, baseline_reasons, max_risk, step_baseline
from policy.budgets import budget_limit, run_budgets
from policy.models import PolicyRule, RiskLevel
from policy.reading import (
    allow_listed_host,
    allowed_hosts,
    http_destination,
    longest_text,
    parse_shell_step,
    rule_matches,
    stdin_counterpart,
    too_large_to_review,
    waived,
)
from policy.rules import policy_snapshot, validate_rule_pattern
from runs.errors import ErrorCode, error_envelope
from runs.models import Run, Step
from runs.plan_schema import validate_plan
from runtime import egress

NO_RULE_MATCHED = "no rule matched (default low)"


@dataclass
class PolicyDecision:
    risk: str  # low | medium | high | deny
    data: dict  # the PolicyDecisionTrace: matched rules, policy version, budgets
    error: dict | None = None  # the envelope when the run is rejected

    @property
    def rejected(self) -> bool:
        return self.risk == "deny"



@dataclass(frozen=True)
class _Match:
    rule: PolicyRule
    rank: int  # the rule's place in priority order
    step: Step


@dataclass
class _Rating:
    """What rating the steps of one plan gathers."""

    compiled: list  # (rule, pattern), in priority order
    allowed: frozenset[str]  # EXECGO_HTTP_ALLOWED_HOSTS
    matches: list[_Match] = field(default_factory=list)
    egress_denied: list[dict] = field(default_factory=list)


def evaluate_policy(run: Run, steps: list[Step] | None = None, *,
                    snapshot: tuple[int, list[PolicyRule]] | None = None) -> PolicyDecision:
    """Rate ``run``'s steps (its stored ones, or ``steps``: a plan an
    approver edited, rated before it replaces the stored one). ``snapshot``:
    the (version, rules) to rate with, rather than the tenant's current
    policy (``policy.replay``'s what-if)."""
    version, rules = snapshot if snapshot is not None else policy_snapshot(run.tenant_id)
    steps = list(run.steps.order_by("position")) if steps is None else steps
    compiled, broken = _compile(rules)
    rating = _Rating(compiled=compiled, allowed=allowed_hosts())
    max_chars = budget_limit("EXECGO_BUDGET_MAX_COMMAND_CHARS")
    step_rows = [_rate_step(step, rating, max_chars) for step in steps]

    matched_rules = [
        {"rule": match.rule.name, "id": match.rule.pk, "outcome": match.rule.outcome, "reason": match.rule.reason,
         "step": match.step.step_id}
        for match in sorted(rating.matches, key=lambda match: (match.rank, match.step.position))
    ] + [
        {"rule": rule.name, "id": rule.pk, "outcome": RiskLevel.DENY, "reason": f"broken rule: {problem}",
         "step": None}
        for rule, problem in broken
    ]
    budget, over_budget = run_budgets(run, steps)
    denying = [entry for entry in matched_rules if entry["outcome"] == RiskLevel.DENY]
    egress_denied = rating.egress_denied

    risk = max_risk(row["risk"] for row in step_rows)
    if denying or over_budget or egress_denied:
        risk = RiskLevel.DENY
    data = {
        "risk": str(risk),
        "policy_version": version,
        "matched_rules": matched_rules,
        "steps": step_rows,
        "budget": budget,
        "rejected_by": "rule" if denying else "budget" if over_budget else "egress" if egress_denied else None,
    }
    error = _denial_envelope(version, denying, over_budget, egress_denied) if risk == RiskLevel.DENY else None
    return PolicyDecision(risk=str(risk), data=data, error=error)


def _compile(rules: list[PolicyRule]) -> tuple[list, list]:
    """The rules with their compiled patterns, and the broken ones with what
    is wrong with each. Rules are validated when saved; one that got in some
    other way must not quietly widen what runs, so it denies the run."""
    compiled, broken = [], []
    for rule in rules:
        try:
            pattern = validate_rule_pattern(rule.pattern)
        except ValidationError:
            broken.append((rule, f"its pattern {rule.pattern!r} is not a valid regular expression"))
            continue
        if rule.outcome not in RISK_ORDER:
            broken.append((rule, f"its outcome {rule.outcome!r} is not one of {', '.join(RISK_ORDER)}"))
            continue
        compiled.append((rule, pattern))
    return compiled, broken


def _rate_step(step: Step, rating: _Rating, max_chars: float) -> dict:
    """One row of the trace's ``steps``: the step's risk and its reasons."""
    if longest_text(step) > max_chars:
        return {"id": step.step_id, "tool": step.tool, "risk": RiskLevel.DENY,
                "reasons": [f"not rated: longer than max_command_chars ({max_chars})"]}
    parsed = parse_shell_step(step)
    counterpart = stdin_counterpart(step, parsed)
    read_as = [(step, parsed)]
    if counterpart is not None:
        read_as.append((counterpart, parse_shell_step(counterpart)))
    reasons, risks, extra = [], [], {}
    if step.tool == "shell":
        extra = _rate_shell_command(step, read_as, reasons, risks)
    destination = http_destination(step)
    if destination is not None:
        said = egress.explain(destination["address"], destination["class"])
        if destination["allow_listed"]:
            risks.append(RiskLevel.HIGH)
            reasons.append(f"egress: {said}, in EXECGO_HTTP_ALLOWED_NETWORKS")
        else:
            risks.append(RiskLevel.DENY)
            reasons.append(f"egress: {said}")
            rating.egress_denied.append({"step": step.step_id, "message": said, **destination})
        extra = {"egress": destination}
    host = allow_listed_host(step, rating.allowed)
    for rank, (rule, pattern) in enumerate(rating.compiled):
        if not any(rule_matches(rule, pattern, one, one_parsed) for one, one_parsed in read_as):
            continue
        if host is not None and waived(rule):
            reasons.append(f"{rule.name} waived: host {host} is in EXECGO_HTTP_ALLOWED_HOSTS")
            continue
        rating.matches.append(_Match(rule, rank, step))
        reasons.append(f"{rule.name}: {rule.reason}")
        risks.append(rule.outcome)
    unreviewable = too_large_to_review(step)
    if unreviewable:
        risks.append(RiskLevel.HIGH)
        reasons.extend(unreviewable)
    return {"id": step.step_id, "tool": step.tool, "risk": max_risk(risks), "reasons": reasons or [NO_RULE_MATCHED],
            **extra}


def _rate_shell_command(step: Step, read_as: list, reasons: list[str], risks: list[str]) -> dict:
    """A shell step's baseline and its parsed command's signals, added to
    ``reasons`` and ``risks``; returns the trace's extra fields for it."""
    parsed = read_as[0][1]
    baseline = step_baseline(step)
    rated_plan = baseline.pop("rated_plan", None)
    risks.append(baseline["risk"])
    reasons.extend(baseline_reasons(baseline))
    seen = list(dict.fromkeys(signal for _, one in read_as if one for signal in one.signals))
    signals = [{"signal": kind, "risk": str(RiskLevel.MEDIUM), "detail": detail} for kind, detail in seen]
    risks.extend(signal["risk"] for signal in signals)
    reasons.extend(f"{signal['signal']}: {signal['detail']}" for signal in signals)
    extra = {"baseline": baseline, "rated_plan": rated_plan,
             "parsed": {"commands": parsed.texts() if parsed else [], "signals": signals}}
    if len(read_as) > 1:
        extra["parsed"]["stdin_program"] = parsed.stdin_program
    return extra


def _denial_envelope(version: int, denying: list[dict], over_budget: list[dict], egress_denied: list[dict]
                     ) -> dict:
    parts = []
    if denying:
        named = ", ".join(f"{entry['rule']} (step {entry['step']})" if entry["step"] else entry["rule"]
                          for entry in denying)
        parts.append(f"denied by policy rule{'s' if len(denying) > 1 else ''} {named}")
    if over_budget:
        named = ", ".join(f"{entry['budget']} ({_number(entry['used'])} > {_number(entry['limit'])})"
                          for entry in over_budget)
        parts.append(f"over the run budget {named}")
    parts.extend(f"step {entry['step']}: {entry['message']}" for entry in egress_denied)
    details = {"policy_version": version, "rules": list(dict.fromkeys(entry["rule"] for entry in denying)),
               "budgets": over_budget}
    if egress_denied:
        details["egress"] = [{key: entry[key] for key in ("step", "address", "class")} for entry in egress_denied]
    return error_envelope(ErrorCode.DENIED, "; ".join(parts), source="policy", retryable=False, details=details)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def policy_dry_run(*, plan: dict, tenant, timeout_s: int | None = None) -> PolicyDecision:
    """``evaluate_policy`` of a plan that is not a run (``POST
    /api/v1/policy/evaluate``): validated like a submission, nothing written."""
    run = Run(tenant=tenant, timeout_s=timeout_s or settings.EXECGO_RUN_TIMEOUT_S)
    steps = [Step(step_id=step["id"], position=position, tool=step["tool"], params=step["params"],
                  depends_on=step["depends_on"], timeout_s=step["timeout_s"], retries=step["retries"],
                  requested_plan=step.get("sandbox") or {})
             for position, step in enumerate(validate_plan(plan))]
    return evaluate_policy(run, steps=steps)
