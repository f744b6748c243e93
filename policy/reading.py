"""What the policy reads of a step: the text of each field a rule can name,
the parsed shell command (and the program its stdin is), where an http step
goes, and the texts too large for an approver to read."""

import json
import re
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from policy.models import PolicyRule, RiskLevel
from policy.rules import ANY_TOOL, Field
from policy.shell_words import INLINE_OPTIONS, SHELLS, ParsedShell, parse_argv, parse_script
from runs.models import Step
from runtime import egress

RATED_FIELDS = ("command", "url", "path")
# The texts of a step an approver must read whole (approvals.models.shown_action shows them).
REVIEWED_TEXTS = {"shell": ("script", "stdin"), "http": ("body",), "file": ("content",)}


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


def rule_matches(rule: PolicyRule, pattern: re.Pattern, step: Step, parsed: ParsedShell | None) -> bool:
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

def allowed_hosts() -> frozenset[str]:
    hosts = settings.EXECGO_HTTP_ALLOWED_HOSTS
    if isinstance(hosts, str) or not all(isinstance(host, str) for host in hosts):
        raise ImproperlyConfigured(f"EXECGO_HTTP_ALLOWED_HOSTS must be a list of host names, not {hosts!r}")
    return frozenset(host.strip().lower() for host in hosts if host.strip())


def allow_listed_host(step: Step, allowed: frozenset[str]) -> str | None:
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


def waived(rule: PolicyRule) -> bool:
    return rule.field == Field.METHOD and rule.outcome != RiskLevel.DENY

def too_large_to_review(step: Step) -> list[str]:
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


def longest_text(step: Step) -> int:
    """The longest text the policy reads of ``step``: a stdin that is a
    program counts as the script it is."""
    longest = max((len(step_field(step, field) or "") for field in RATED_FIELDS), default=0)
    params = step.params if isinstance(step.params, dict) else {}
    if step.tool == "shell" and "stdin" in params and len(_text(params["stdin"])) > longest:
        parsed = parse_shell_step(step)
        if parsed is not None and parsed.stdin_program:
            longest = len(parsed.stdin)
    return longest
