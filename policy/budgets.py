"""The run budgets: what a plan may ask for at most (settings
``EXECGO_BUDGET_MAX_*``; docs/policy.md, "Budgets")."""

from collections import Counter
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from policy.reading import longest_text
from runs.models import Run, Step

BUDGETS = (
    # (name, setting)
    ("steps", "EXECGO_BUDGET_MAX_STEPS"),
    ("run_seconds", "EXECGO_BUDGET_MAX_RUN_SECONDS"),
    ("cpu_seconds", "EXECGO_BUDGET_MAX_CPU_SECONDS"),
    ("http_calls", "EXECGO_BUDGET_MAX_HTTP_CALLS"),
    ("command_chars", "EXECGO_BUDGET_MAX_COMMAND_CHARS"),
)


def budget_limit(setting: str) -> float:
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


def _budget_usage(run: Run, steps: list[Step]) -> dict[str, float]:
    shell_steps = [step for step in steps if step.tool == "shell"]
    cpu = min(sum(_step_cpu_bound(step, run) for step in shell_steps), run.timeout_s * _plan_width(shell_steps))
    return {
        "steps": len(steps),
        "run_seconds": run.timeout_s,
        "cpu_seconds": round(cpu, 3),
        "http_calls": sum(1 + step.retries for step in steps if step.tool == "http"),
        "command_chars": max((longest_text(step) for step in steps), default=0),
    }


def run_budgets(run: Run, steps: list[Step]) -> tuple[dict[str, float], list[dict[str, Any]]]:
    usage = _budget_usage(run, steps)
    trace: dict[str, float] = {}
    exceeded = []
    for name, setting in BUDGETS:
        limit, used = budget_limit(setting), usage[name]
        trace.update({f"max_{name}": limit, name: used, f"remaining_{name}": max(limit - used, 0)})
        if used > limit:
            exceeded.append({"budget": f"max_{name}", "limit": limit, "used": used})
    return trace, exceeded

