"""POLICY_CHECK: rate every tool call of a plan against the policy rules and
the run budgets, and the services that change the rules.

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

Then the parsed command (``runs.shell_words``) adds its *signals*: a command
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

import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from runs.dataplane import best_plan, rated_part, routed_plan
from runs.errors import ErrorCode, error_envelope
from runs.models import PolicyRule, PolicyVersion, RiskLevel, Run, Step
from runs.plan_schema import KNOWN_TOOLS, validate_plan
from runs.shell_words import INLINE_OPTIONS, SHELLS, ParsedShell, parse_argv, parse_script
from runtime import egress
from runtime.capabilities import capability_manifest
from runtime.envelopes import EnvelopeError

ANY_TOOL = "*"
RISK_ORDER = {RiskLevel.LOW: 0, RiskLevel.MEDIUM: 1, RiskLevel.HIGH: 2, RiskLevel.DENY: 3}
Field = PolicyRule.Field
FIELDS_OF_TOOL = {
    "shell": {Field.ARGV, Field.SCRIPT, Field.COMMAND, Field.WORDS},
    "http": {Field.URL, Field.METHOD},
    "file": {Field.PATH, Field.OP},
}
BUDGETS = (
    # (name, setting)
    ("steps", "EXECGO_BUDGET_MAX_STEPS"),
    ("run_seconds", "EXECGO_BUDGET_MAX_RUN_SECONDS"),
    ("cpu_seconds", "EXECGO_BUDGET_MAX_CPU_SECONDS"),
    ("http_calls", "EXECGO_BUDGET_MAX_HTTP_CALLS"),
    ("command_chars", "EXECGO_BUDGET_MAX_COMMAND_CHARS"),
)
NO_RULE_MATCHED = "no rule matched (default low)"
MAX_SNAPSHOT_ATTEMPTS = 5


@dataclass
class PolicyDecision:
    risk: str  # low | medium | high | deny
    data: dict  # the PolicyDecisionTrace: matched rules, policy version, budgets
    error: dict | None = None  # the envelope when the run is rejected

    @property
    def rejected(self) -> bool:
        return self.risk == "deny"


# --- rule changes -----------------------------------------------------------


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


# --- evaluation -------------------------------------------------------------


@dataclass(frozen=True)
class _Match:
    rule: PolicyRule
    rank: int  # the rule's place in priority order
    step: Step


def _text(value: Any) -> str:
    return value if isinstance(value, str) else str(value)


def step_field(step: Step, field: str) -> str | None:
    """The text a rule on ``field`` searches in ``step``; None when the step
    has no such field."""
    params = step.params if isinstance(step.params, dict) else {}
    if step.tool == "shell":
        argv = params.get("argv")
        joined = " ".join(_text(arg) for arg in argv) if isinstance(argv, list) else None
        script = _text(params["script"]) if "script" in params else None
        return {Field.ARGV: joined, Field.SCRIPT: script,
                Field.COMMAND: joined if joined is not None else script}.get(field)
    if step.tool == "http":
        if field == Field.METHOD:
            return _text(params.get("method", "GET")).upper()  # the http tool's default
        if field == Field.URL and "url" in params:
            return _text(params["url"])
        return None
    if step.tool == "file":
        if field == Field.OP and "op" in params:
            return _text(params["op"])
        if field == Field.PATH:
            if "path" in params:
                return _text(params["path"])
            return "." if params.get("op") == "list" else None  # the file tool's default for list
    return None


def parse_shell_step(step: Step) -> ParsedShell | None:
    """The parsed command of a shell step (None for other tools, or a shell
    step with neither argv nor script), its stdin included."""
    params = step.params if isinstance(step.params, dict) else {}
    if step.tool != "shell":
        return None
    stdin = _text(params["stdin"]) if "stdin" in params else None
    if isinstance(params.get("argv"), list):
        return parse_argv([_text(arg) for arg in params["argv"]], stdin=stdin)
    if "script" in params:
        return parse_script(_text(params["script"]), stdin=stdin)
    return None


def stdin_counterpart(step: Step, parsed: ParsedShell | None) -> Step | None:
    """A shell step whose stdin is a program, as that program given the way
    the policy reads best: a shell's as the step's ``script``, an
    interpreter's as inline code (``python3 -c …``). The step is rated as
    itself and as this, whichever is higher, so feeding a program on stdin
    never rates lower than writing it out."""
    if parsed is None or not parsed.stdin_program or parsed.stdin is None:
        return None
    params = {key: value for key, value in step.params.items() if key in ("cwd", "env")}
    program = parsed.stdin_program
    if program.lower() in SHELLS:
        params["script"] = parsed.stdin
    else:
        family = re.sub(r"[0-9.]+$", "", program.lower())
        option = sorted(INLINE_OPTIONS.get(family) or {"-c"})[0]
        params["argv"] = [program, option, parsed.stdin]
    return Step(run_id=step.run_id, step_id=step.step_id, position=step.position, tool=step.tool, params=params,
                depends_on=step.depends_on, timeout_s=step.timeout_s, retries=step.retries,
                requested_plan=step.requested_plan)


def _rule_matches(rule: PolicyRule, pattern: re.Pattern, step: Step, parsed: ParsedShell | None) -> bool:
    if rule.tool not in (ANY_TOOL, step.tool):
        return False
    if rule.field == Field.WORDS:
        if parsed is None:
            return False
        found = any(pattern.search(text) is not None for text in parsed.texts())
        return not found if rule.negate else found
    text = step_field(step, rule.field)
    if text is None:
        return False
    return (pattern.search(text) is None) if rule.negate else (pattern.search(text) is not None)


# --- the capability baseline of a shell step ---------------------------------

CONTAINED_NETWORKS = {
    "none": "no network: only the namespace's own loopback",
    "loopback": "only the namespace's own loopback",
}
NETWORK_REACH = {
    "internet": "a NAT'd network namespace: it cannot reach the host's loopback, but nothing proves it keeps off "
                "the host's other addresses",
    "host": "the host's own network: the database, broker and web on 127.0.0.1 included",
}
# "read_only_host_workspace_rw": an earlier spelling of "workspace" by the resolver.
WORKSPACE_FILESYSTEMS = {"workspace", "read_only_host_workspace_rw"}


def _check(what: str, value: Any, risk: str, reason: str) -> dict:
    return {"check": what, "value": value, "risk": str(risk), "reason": reason}


def plan_baseline(plan: dict, *, worker_is_root: bool) -> dict:
    """The risk a shell step starts from, from what its effective ``plan``
    lets it reach, with the check behind each part of it."""
    checks = []
    profile, network, filesystem = plan.get("profile"), plan.get("network"), plan.get("filesystem")
    if profile == "linux_sandbox" and plan.get("seccomp") is False:
        checks.append(_check("profile", profile, RiskLevel.MEDIUM,
                             "sandboxed (bubblewrap) without its system call filter: the whole kernel interface "
                             "is open to the command"))
    elif profile == "linux_sandbox":
        checks.append(_check("profile", profile, RiskLevel.LOW, "sandboxed (bubblewrap)"))
    elif profile == "process" and plan.get("namespaces"):
        checks.append(_check("profile", profile, RiskLevel.MEDIUM,
                             "the shim's own mount and network namespaces, nosuid and no_new_privs, but no system "
                             "call filter, the host's user namespace, and the host's root writable wherever its "
                             "uid may write"))
    else:
        checks.append(_check("profile", profile, RiskLevel.HIGH,
                             "not sandboxed: the command runs on the host with only rlimits around it"))
    if network in CONTAINED_NETWORKS:
        checks.append(_check("network", network, RiskLevel.LOW, CONTAINED_NETWORKS[network]))
    else:
        checks.append(_check("network", network, RiskLevel.HIGH,
                             NETWORK_REACH.get(network, "a network the policy does not know: assumed to reach all")))
    if filesystem in WORKSPACE_FILESYSTEMS and profile == "process":
        checks.append(_check("filesystem", filesystem, RiskLevel.LOW,
                             "the host without the data dir, nosuid,nodev, a workspace of its own"))
    elif filesystem in WORKSPACE_FILESYSTEMS:
        checks.append(_check("filesystem", filesystem, RiskLevel.LOW,
                             "the host's system directories read-only, only the workspace writable"))
        readonly = plan.get("readonly_paths") or []
        if readonly:
            checks.append(_check("readonly_paths", readonly, RiskLevel.MEDIUM,
                                 "host paths the step can read besides the system directories: "
                                 + ", ".join(readonly)))
    else:
        reason = ("the host's filesystem, writable wherever its uid may write" if filesystem == "host"
                  else "a filesystem view the policy does not know: assumed to be the host's")
        checks.append(_check("filesystem", filesystem, RiskLevel.HIGH, reason))
    uid = plan.get("uid")
    if uid == 0 or (uid is None and worker_is_root):
        checks.append(_check("uid", uid, RiskLevel.HIGH, "runs as root" if uid == 0 else
                             "runs as the worker's own uid, which is root"))
    else:
        # The value is "own" rather than the number: each step has its own, and the reasons stay the same
        # from a dry run to the policy check.
        checks.append(_check("uid", "own" if uid is not None else "worker", RiskLevel.LOW,
                             "runs as a uid of its own" if uid is not None else
                             "runs as the worker's own (non-root) uid"))
    limits = plan.get("limits") if isinstance(plan.get("limits"), dict) else {}
    if limits.get("processes") is None:
        checks.append(_check("limits.processes", None, RiskLevel.MEDIUM,
                             "no process limit: a fork bomb is stopped only by the step's timeout"))
    else:
        checks.append(_check("limits.processes", limits["processes"], RiskLevel.LOW,
                             f"at most {limits['processes']} processes"))
    for downgrade in plan.get("downgrades") or []:
        checks.append(_check(f"downgrade {downgrade.get('what')}", downgrade.get("effective"), RiskLevel.LOW,
                             f"asked for {downgrade.get('requested')!r}: {downgrade.get('reason')}"))
    risk = _max_risk(check["risk"] for check in checks)
    return {"risk": str(risk), "checks": checks,
            "plan": {"profile": profile, "network": network, "filesystem": filesystem,
                     "readonly_paths": plan.get("readonly_paths") or [], "uid": uid,
                     "processes": limits.get("processes"), "downgrades": len(plan.get("downgrades") or [])}}


def _worker_is_root() -> bool:
    return bool((capability_manifest().get("user") or {}).get("is_root"))


def step_baseline(step: Step) -> dict:
    """The baseline of ``step`` from the plan it will run with: this host's,
    or a stronger one another host gives it (``runs.dataplane.best_plan``)."""
    try:
        plan = best_plan(step)
    except EnvelopeError as exc:
        # A strict sandbox step runs only on hosts that have the sandbox: rate
        # the plan it gets there, not this host's refusal.
        try:
            plan = routed_plan(step)
        except EnvelopeError:
            plan = None
        if plan is None:
            check = _check("plan", None, RiskLevel.HIGH, f"the execution plan cannot be resolved on this host "
                                                         f"({exc.envelope['message']}): what it can reach is unknown")
            return {"risk": str(RiskLevel.HIGH), "checks": [check], "plan": None}
    # The plan rated, for the step to be bound to (taken off by evaluate_policy).
    return {**plan_baseline(plan, worker_is_root=_worker_is_root()), "rated_plan": rated_part(plan)}


def baseline_reasons(baseline: dict) -> list[str]:
    """The checks that set the baseline (and any above low), for the step's reasons."""
    raised = [check for check in baseline["checks"] if check["risk"] != RiskLevel.LOW]
    if raised:
        return [f"baseline {check['risk']}: {check['check']} {check['value']} - {check['reason']}"
                for check in raised]
    return ["baseline low: " + ", ".join(f"{check['check']} {check['value']}" for check in baseline["checks"])]


def _allowed_hosts() -> frozenset[str]:
    hosts = settings.EXECGO_HTTP_ALLOWED_HOSTS
    if isinstance(hosts, str) or not all(isinstance(host, str) for host in hosts):
        raise ImproperlyConfigured(f"EXECGO_HTTP_ALLOWED_HOSTS must be a list of host names, not {hosts!r}")
    return frozenset(host.strip().lower() for host in hosts if host.strip())


def _allow_listed_host(step: Step, allowed: frozenset[str]) -> str | None:
    if step.tool != "http" or not allowed:
        return None
    try:
        host = urlsplit(step_field(step, Field.URL) or "").hostname
    except ValueError:
        return None
    return host if host in allowed else None


def http_destination(step: Step) -> dict | None:
    """The internal destination of an http step (``egress.rate_destination``), or None."""
    if step.tool != "http":
        return None
    try:
        parts = urlsplit(step_field(step, Field.URL) or "")
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    if not parts.hostname:
        return None
    return egress.rate_destination(parts.hostname, port)


def _waived(rule: PolicyRule) -> bool:
    return rule.field == Field.METHOD and rule.outcome != RiskLevel.DENY


def _policy_snapshot() -> tuple[int, list[PolicyRule]]:
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


def _budget_limit(setting: str) -> float:
    # Settings are read by name (the table above); a value set in code
    # rather than from the environment is checked here.
    value = getattr(settings, setting)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ImproperlyConfigured(f"{setting} must be a non-negative number, not {value!r}")
    return value


def _plan_width(steps: list[Step]) -> int:
    """The most steps at one dependency depth (depth = longest path from a root)."""
    depth: dict[str, int] = {}
    for step in steps:  # stored in dependency order
        depth[step.step_id] = 1 + max((depth[dep] for dep in step.depends_on if dep in depth), default=-1)
    return max(Counter(depth.values()).values(), default=0)


def _step_cpu_bound(step: Step, run: Run) -> float:
    declared = ((step.requested_plan or {}).get("limits") or {}).get("cpu_seconds")
    per_attempt = declared if declared else step.timeout_s
    return min(per_attempt * (1 + step.retries), run.timeout_s)


RATED_FIELDS = ("command", "url", "path")


# The texts of a step an approver must read whole (approvals.models.shown_action shows them).
REVIEWED_TEXTS = {"shell": ("script", "stdin"), "http": ("body",), "file": ("content",)}


def _too_large_to_review(step: Step) -> list[str]:
    """A reason for each text of ``step`` longer than an approval shows
    (``EXECGO_APPROVAL_SHOW_MAX_BYTES``): nobody could approve it having read
    it, so it is rated at least high."""
    params = step.params if isinstance(step.params, dict) else {}
    cap, reasons = settings.EXECGO_APPROVAL_SHOW_MAX_BYTES, []
    for key in REVIEWED_TEXTS.get(step.tool, ()):
        if key in params:
            value = params[key]
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True,
                                                                    indent=2)
            if len(text.encode()) > cap:
                reasons.append(f"too large to review: its {key} is {len(text.encode())} bytes, over the "
                               f"{cap} an approval shows")
    return reasons


def _longest_text(step: Step) -> int:
    """The longest text the policy reads of ``step``: a stdin that is a
    program counts as the script it is."""
    longest = max((len(step_field(step, field) or "") for field in RATED_FIELDS), default=0)
    params = step.params if isinstance(step.params, dict) else {}
    if step.tool == "shell" and "stdin" in params and len(_text(params["stdin"])) > longest:
        parsed = parse_shell_step(step)
        if parsed is not None and parsed.stdin_program:
            longest = len(parsed.stdin)
    return longest


def _budget_usage(run: Run, steps: list[Step]) -> dict[str, float]:
    shell_steps = [step for step in steps if step.tool == "shell"]
    cpu = min(sum(_step_cpu_bound(step, run) for step in shell_steps), run.timeout_s * _plan_width(shell_steps))
    return {
        "steps": len(steps),
        "run_seconds": run.timeout_s,
        "cpu_seconds": round(cpu, 3),
        "http_calls": sum(1 + step.retries for step in steps if step.tool == "http"),
        "command_chars": max((_longest_text(step) for step in steps), default=0),
    }


def _budgets(run: Run, steps: list[Step]) -> tuple[dict[str, float], list[dict[str, Any]]]:
    usage = _budget_usage(run, steps)
    trace: dict[str, float] = {}
    exceeded = []
    for name, setting in BUDGETS:
        limit, used = _budget_limit(setting), usage[name]
        trace.update({f"max_{name}": limit, name: used, f"remaining_{name}": max(limit - used, 0)})
        if used > limit:
            exceeded.append({"budget": f"max_{name}", "limit": limit, "used": used})
    return trace, exceeded


def _max_risk(risks: Iterable[str]) -> str:
    return max(risks, key=RISK_ORDER.__getitem__, default=RiskLevel.LOW)


def evaluate_policy(run: Run, steps: list[Step] | None = None) -> PolicyDecision:
    """Rate ``run``'s steps (its stored ones, or ``steps``: a plan an
    approver edited, rated before it replaces the stored one)."""
    version, rules = _policy_snapshot()
    steps = list(run.steps.order_by("position")) if steps is None else steps
    allowed = _allowed_hosts()

    compiled, broken = [], []
    for rule in rules:
        # Rules are validated when saved; one that got in some other way
        # must not quietly widen what runs, so it denies the run.
        try:
            pattern = validate_rule_pattern(rule.pattern)
        except ValidationError:
            broken.append((rule, f"its pattern {rule.pattern!r} is not a valid regular expression"))
            continue
        if rule.outcome not in RISK_ORDER:
            broken.append((rule, f"its outcome {rule.outcome!r} is not one of {', '.join(RISK_ORDER)}"))
            continue
        compiled.append((rule, pattern))

    max_chars = _budget_limit("EXECGO_BUDGET_MAX_COMMAND_CHARS")
    matches: list[_Match] = []
    egress_denied: list[dict] = []
    step_rows = []
    for step in steps:
        if _longest_text(step) > max_chars:
            step_rows.append({"id": step.step_id, "tool": step.tool, "risk": RiskLevel.DENY,
                              "reasons": [f"not rated: longer than max_command_chars ({max_chars})"]})
            continue
        host = _allow_listed_host(step, allowed)
        unreviewable = _too_large_to_review(step)
        parsed = parse_shell_step(step)
        counterpart = stdin_counterpart(step, parsed)
        read_as = [(step, parsed)]
        if counterpart is not None:
            read_as.append((counterpart, parse_shell_step(counterpart)))
        reasons, risks, extra = [], [], {}
        if step.tool == "shell":
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
            if counterpart is not None:
                extra["parsed"]["stdin_program"] = parsed.stdin_program
        destination = http_destination(step)
        if destination is not None:
            said = egress.explain(destination["address"], destination["class"])
            if destination["allow_listed"]:
                risks.append(RiskLevel.HIGH)
                reasons.append(f"egress: {said}, in EXECGO_HTTP_ALLOWED_NETWORKS")
            else:
                risks.append(RiskLevel.DENY)
                reasons.append(f"egress: {said}")
                egress_denied.append({"step": step.step_id, "message": said, **destination})
            extra = {"egress": destination}
        for rank, (rule, pattern) in enumerate(compiled):
            if not any(_rule_matches(rule, pattern, one, one_parsed) for one, one_parsed in read_as):
                continue
            if host is not None and _waived(rule):
                reasons.append(f"{rule.name} waived: host {host} is in EXECGO_HTTP_ALLOWED_HOSTS")
                continue
            matches.append(_Match(rule, rank, step))
            reasons.append(f"{rule.name}: {rule.reason}")
            risks.append(rule.outcome)
        if unreviewable:
            risks.append(RiskLevel.HIGH)
            reasons.extend(unreviewable)
        step_rows.append({"id": step.step_id, "tool": step.tool, "risk": _max_risk(risks),
                          "reasons": reasons or [NO_RULE_MATCHED], **extra})

    matched_rules = [
        {"rule": match.rule.name, "id": match.rule.pk, "outcome": match.rule.outcome, "reason": match.rule.reason,
         "step": match.step.step_id}
        for match in sorted(matches, key=lambda match: (match.rank, match.step.position))
    ] + [
        {"rule": rule.name, "id": rule.pk, "outcome": RiskLevel.DENY, "reason": f"broken rule: {problem}",
         "step": None}
        for rule, problem in broken
    ]
    budget, over_budget = _budgets(run, steps)
    denying = [entry for entry in matched_rules if entry["outcome"] == RiskLevel.DENY]

    risk = _max_risk(row["risk"] for row in step_rows)
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
