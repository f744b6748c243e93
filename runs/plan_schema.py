"""Validation of an agent-supplied plan (the static planner's contract).

Used twice on purpose with one implementation: by the API, so a bad plan is
a 400 before anything is stored, and by PLANNING, which is the stage that
owns the decision (a plan arriving by another route is checked there too).
"""

import re
from collections.abc import Iterable
from typing import Any

from django.conf import settings

from runs.errors import ErrorCode, ExecGoError
from runtime.envelopes import EnvelopeError
from runtime.plan_resolver import MODES, NETWORKS, PROFILES, normalize_limits
from runtime.tools import validate_params

KNOWN_TOOLS = ("shell", "http", "file")
STEP_KEYS = {"id", "tool", "params", "depends_on", "timeout_s", "retries", "sandbox"}
MAX_STEP_ID_LENGTH = 100
MAX_RETRIES = 10


# What neither database stores in text or JSON: PostgreSQL refuses NUL in
# text and \u0000 in jsonb, and a lone surrogate cannot be encoded as UTF-8
# at all (SQLite's driver and psycopg both raise).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def _unstorable_in(text: str) -> str | None:
    found = _UNSTORABLE.search(text)
    if found is None:
        return None
    return "a NUL character" if found.group() == "\x00" else "a lone surrogate"


def find_unstorable(value: Any, path: str = "") -> tuple[str, str] | None:
    """The first string (a key or a value, at any depth) that no database
    can store, as ``(path, what)``; None when every string is storable.
    Iterative: a value is walked without recursion whatever its depth."""
    pending: list[tuple[str, Any]] = [(path, value)]
    while pending:
        where, item = pending.pop()
        if isinstance(item, str):
            what = _unstorable_in(item)
            if what is not None:
                return where or "(value)", what
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and (what := _unstorable_in(key)) is not None:
                    return f"{where}{'.' if where else ''}{key!r}", f"{what} in a key"
                pending.append((f"{where}{'.' if where else ''}{key}", child))
        elif isinstance(item, (list, tuple)):
            pending.extend((f"{where}[{index}]", child) for index, child in enumerate(item))
    return None


def unstorable_error(value: Any, *, path: str = "", source: str = "scheduler") -> ExecGoError | None:
    """An ``invalid_input`` error naming the first unstorable string of
    ``value``, or None."""
    found = find_unstorable(value, path)
    if found is None:
        return None
    where, what = found
    return ExecGoError(ErrorCode.INVALID_INPUT, f"{where} contains {what}, which cannot be stored",
                       source=source, retryable=False, details={"path": where})


def _invalid(message: str, **details: Any) -> ExecGoError:
    return ExecGoError(ErrorCode.INVALID_INPUT, message, source="scheduler", details=details)


def _validate_tool_params(step_id: str, tool: str, params: Any) -> None:
    try:
        validate_params(tool, params)
    except EnvelopeError as exc:
        raise ExecGoError(exc.code, f"step {step_id!r}: {exc.envelope['message']}", source="scheduler",
                          details={"step": step_id, **exc.envelope["details"]}) from None


def _validate_sandbox(step_id: str, sandbox: Any) -> dict:
    """Syntax only: whether a host can honour it is decided where the step runs."""
    if not isinstance(sandbox, dict) or set(sandbox) - {"profile", "mode", "network", "limits"}:
        raise _invalid(f"step {step_id!r}: sandbox must be an object with profile, mode, network and limits",
                       step=step_id)
    if sandbox.get("profile", "linux_sandbox") not in PROFILES:
        raise _invalid(f"step {step_id!r}: sandbox.profile must be one of {', '.join(PROFILES)}", step=step_id)
    if sandbox.get("mode", "adaptive") not in MODES:
        raise _invalid(f"step {step_id!r}: sandbox.mode must be one of {', '.join(MODES)}", step=step_id)
    if sandbox.get("network", "none") not in NETWORKS:
        raise _invalid(f"step {step_id!r}: sandbox.network must be one of {', '.join(NETWORKS)}", step=step_id)
    try:
        normalize_limits(sandbox.get("limits"))
    except EnvelopeError as exc:
        raise _invalid(f"step {step_id!r}: {exc.envelope['message']}", step=step_id) from None
    return sandbox


def validate_plan(plan: Any) -> list[dict]:
    """Return the plan's steps in a dependency-respecting order, normalised
    (defaults filled in); raise an ``invalid_input`` ExecGoError naming the
    exact problem otherwise."""
    if not isinstance(plan, dict) or set(plan) - {"steps"}:
        raise _invalid("plan must be an object with a single 'steps' list")
    # Before anything else reads it: a plan can also come from a planner.
    if (error := unstorable_error(plan, path="plan")) is not None:
        raise error
    steps = plan.get("steps")
    if not isinstance(steps, list) or not steps:
        raise _invalid("plan.steps must be a non-empty list")
    if len(steps) > settings.EXECGO_MAX_PLAN_STEPS:
        raise _invalid(f"plan has {len(steps)} steps; the limit is {settings.EXECGO_MAX_PLAN_STEPS}",
                       limit=settings.EXECGO_MAX_PLAN_STEPS)

    normalised: dict[str, dict] = {}
    for index, raw in enumerate(steps):
        if not isinstance(raw, dict):
            raise _invalid(f"plan.steps[{index}] must be an object", index=index)
        unknown = set(raw) - STEP_KEYS
        if unknown:
            raise _invalid(f"plan.steps[{index}] has unknown fields: {', '.join(sorted(unknown))}", index=index)
        step_id = raw.get("id")
        if not isinstance(step_id, str) or not step_id or len(step_id) > MAX_STEP_ID_LENGTH:
            raise _invalid(f"plan.steps[{index}].id must be a non-empty string of at most "
                           f"{MAX_STEP_ID_LENGTH} characters", index=index)
        if step_id in normalised:
            raise _invalid(f"duplicate step id {step_id!r}", step=step_id)
        tool = raw.get("tool")
        if tool not in KNOWN_TOOLS:
            raise _invalid(f"step {step_id!r}: unknown tool {tool!r} (known: {', '.join(KNOWN_TOOLS)})",
                           step=step_id)
        params = raw.get("params", {})
        if not isinstance(params, dict):
            raise _invalid(f"step {step_id!r}: params must be an object", step=step_id)
        _validate_tool_params(step_id, tool, params)
        sandbox = _validate_sandbox(step_id, raw["sandbox"]) if "sandbox" in raw else {}
        depends_on = raw.get("depends_on", [])
        if not isinstance(depends_on, list) or not all(isinstance(d, str) for d in depends_on):
            raise _invalid(f"step {step_id!r}: depends_on must be a list of step ids", step=step_id)
        timeout_s = raw.get("timeout_s", settings.EXECGO_STEP_TIMEOUT_S)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 86400:
            raise _invalid(f"step {step_id!r}: timeout_s must be a number in (0, 86400]", step=step_id)
        retries = raw.get("retries", 0)
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_RETRIES:
            raise _invalid(f"step {step_id!r}: retries must be an integer in [0, {MAX_RETRIES}]", step=step_id)
        normalised[step_id] = {"id": step_id, "tool": tool, "params": params,
                               "depends_on": list(dict.fromkeys(depends_on)),
                               "timeout_s": float(timeout_s), "retries": retries, "sandbox": sandbox}

    for step in normalised.values():
        for dependency in step["depends_on"]:
            if dependency not in normalised:
                raise _invalid(f"step {step['id']!r} depends on unknown step {dependency!r}", step=step["id"])
            if dependency == step["id"]:
                raise _invalid(f"step {step['id']!r} depends on itself", step=step["id"])
    return _topological_order(normalised)


def _topological_order(steps: dict[str, dict]) -> list[dict]:
    """Kahn's algorithm, stable in plan order; a leftover means a cycle."""
    remaining = {step_id: set(step["depends_on"]) for step_id, step in steps.items()}
    ordered: list[dict] = []
    while remaining:
        ready = [step_id for step_id, deps in remaining.items() if not deps]
        if not ready:
            cycle = sorted(remaining)
            raise _invalid(f"plan has a dependency cycle among steps: {', '.join(cycle)}", steps=cycle)
        for step_id in ready:
            ordered.append(steps[step_id])
            del remaining[step_id]
        for deps in remaining.values():
            deps.difference_update(ready)
    return ordered


def step_ids(steps: Iterable[dict]) -> list[str]:
    return [step["id"] for step in steps]
