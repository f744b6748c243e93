"""The RunState machine as data (docs/state-machine.md).

This module is the single source of the transition table: the django-fsm
``@transition`` declarations on ``Run`` read it, the transition service
checks against it, and the tests walk it. Nothing here touches the database.

    CREATED → PREPARING → PLANNING → POLICY_CHECK → (AWAITING_HITL) → EXECUTING
        │          │           │             │               │              │
        └──────────┴─ FAILED / TIMEOUT / REJECTED / CANCELLED (transient) ──┤
                                        ↓                                    ↓
                                     TRACING  ←──────────── success ─────────┘
                                        ↓
          SUCCEEDED | CLOSED_REJECTED | CLOSED_FAILED | CLOSED_CANCELLED (final)
"""

from dataclasses import dataclass

from django.db import models


class RunState(models.TextChoices):
    CREATED = "CREATED"
    PREPARING = "PREPARING"
    PLANNING = "PLANNING"
    POLICY_CHECK = "POLICY_CHECK"
    AWAITING_HITL = "AWAITING_HITL"
    EXECUTING = "EXECUTING"
    TRACING = "TRACING"
    REJECTED = "REJECTED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    CANCELLED = "CANCELLED"
    SUCCEEDED = "SUCCEEDED"
    CLOSED_REJECTED = "CLOSED_REJECTED"
    CLOSED_FAILED = "CLOSED_FAILED"
    CLOSED_CANCELLED = "CLOSED_CANCELLED"


S = RunState

MAIN_PATH = frozenset({S.CREATED, S.PREPARING, S.PLANNING, S.POLICY_CHECK, S.AWAITING_HITL, S.EXECUTING})
TRANSIENT = frozenset({S.REJECTED, S.FAILED, S.TIMEOUT, S.CANCELLED})
FINAL = frozenset({S.SUCCEEDED, S.CLOSED_REJECTED, S.CLOSED_FAILED, S.CLOSED_CANCELLED})
NON_FINAL = frozenset(S) - FINAL

ZOMBIE_SWEEPER = "zombie_sweeper"


class ClosingCause(models.TextChoices):
    """Why a run entered TRACING; decides which final state it closes into."""

    SUCCEEDED = "succeeded"
    REJECTED = "rejected"
    FAILED = "failed"
    CANCELLED = "cancelled"
    APPROVAL_TIMEOUT = "approval_timeout"  # TIMEOUT that came from AWAITING_HITL
    PLANNING_TIMEOUT = "planning_timeout"  # TIMEOUT that came from PLANNING
    RUN_TIMEOUT = "run_timeout"  # TIMEOUT that came from EXECUTING


FINAL_STATE_FOR_CAUSE: dict[str, RunState] = {
    ClosingCause.SUCCEEDED: S.SUCCEEDED,
    ClosingCause.REJECTED: S.CLOSED_REJECTED,
    ClosingCause.APPROVAL_TIMEOUT: S.CLOSED_REJECTED,
    ClosingCause.FAILED: S.CLOSED_FAILED,
    ClosingCause.PLANNING_TIMEOUT: S.CLOSED_FAILED,
    ClosingCause.RUN_TIMEOUT: S.CLOSED_FAILED,
    ClosingCause.CANCELLED: S.CLOSED_CANCELLED,
}

_TIMEOUT_CAUSE_BY_ORIGIN = {
    S.AWAITING_HITL: ClosingCause.APPROVAL_TIMEOUT,
    S.PLANNING: ClosingCause.PLANNING_TIMEOUT,
    S.EXECUTING: ClosingCause.RUN_TIMEOUT,
}


def closing_cause_for(entering_from: str, origin: str | None) -> ClosingCause:
    """The closing cause of a run entering TRACING from ``entering_from``.

    ``origin`` is the state before ``entering_from``; it tells a TIMEOUT of an
    approval (closes as rejected) from a TIMEOUT of work (closes as failed).
    """
    if entering_from == S.EXECUTING:
        return ClosingCause.SUCCEEDED
    if entering_from == S.REJECTED:
        return ClosingCause.REJECTED
    if entering_from == S.FAILED:
        return ClosingCause.FAILED
    if entering_from == S.CANCELLED:
        return ClosingCause.CANCELLED
    if entering_from == S.TIMEOUT:
        return _TIMEOUT_CAUSE_BY_ORIGIN.get(origin, ClosingCause.RUN_TIMEOUT)
    raise ValueError(f"no closing cause for entering TRACING from {entering_from}")


@dataclass(frozen=True)
class Edge:
    source: RunState
    target: RunState
    triggered_by: str
    guard: str
    sweeper_only: bool = False


TRANSITIONS: tuple[Edge, ...] = (
    Edge(S.CREATED, S.PREPARING, "run manager", "request complete"),
    Edge(S.PREPARING, S.PLANNING, "context assembler", "context assembled within budget"),
    Edge(S.PREPARING, S.FAILED, "context assembler", "recall error / over budget / cross-tenant data"),
    Edge(S.PLANNING, S.POLICY_CHECK, "planner", "valid plan produced"),
    Edge(S.PLANNING, S.FAILED, "planner", "retries exhausted / plan invalid"),
    Edge(S.PLANNING, S.TIMEOUT, "planner", "planner call exceeded the step timeout"),
    Edge(S.POLICY_CHECK, S.EXECUTING, "hitl controller", "risk in {low, medium}"),
    Edge(S.POLICY_CHECK, S.AWAITING_HITL, "hitl controller", "risk high, approval requested"),
    Edge(S.POLICY_CHECK, S.REJECTED, "hitl controller", "denylist / not permitted / over budget"),
    Edge(S.AWAITING_HITL, S.EXECUTING, "hitl controller", "decision = approve"),
    Edge(S.AWAITING_HITL, S.REJECTED, "hitl controller", "decision = reject"),
    Edge(S.AWAITING_HITL, S.TIMEOUT, "hitl controller", "approval expired"),
    Edge(S.AWAITING_HITL, S.CANCELLED, "user", "request withdrawn"),
    Edge(S.EXECUTING, S.TRACING, "tool controller", "every step succeeded"),
    Edge(S.EXECUTING, S.FAILED, "tool controller", "tool error, retries exhausted"),
    Edge(S.EXECUTING, S.TIMEOUT, "tool controller", "run over its timeout"),
    Edge(S.EXECUTING, S.CANCELLED, "user", "run stopped"),
    Edge(S.REJECTED, S.TRACING, "state machine", "forced"),
    Edge(S.FAILED, S.TRACING, "state machine", "forced"),
    Edge(S.TIMEOUT, S.TRACING, "state machine", "forced"),
    Edge(S.CANCELLED, S.TRACING, "state machine", "forced"),
    Edge(S.TRACING, S.SUCCEEDED, "tracer", "closing cause succeeded"),
    Edge(S.TRACING, S.CLOSED_REJECTED, "tracer", "closing cause rejected / approval timeout"),
    Edge(S.TRACING, S.CLOSED_FAILED, "tracer", "closing cause failed / planning or run timeout"),
    Edge(S.TRACING, S.CLOSED_CANCELLED, "tracer", "closing cause cancelled"),
    # Sweeper-only, legal only with forced_by="zombie_sweeper"
    # (docs/state-machine.md#sweeper-only-transitions).
    Edge(S.CREATED, S.FAILED, "zombie sweeper", "stuck in CREATED", sweeper_only=True),
    Edge(S.POLICY_CHECK, S.FAILED, "zombie sweeper", "stuck in POLICY_CHECK", sweeper_only=True),
    Edge(S.TRACING, S.FAILED, "zombie sweeper", "trace write failed", sweeper_only=True),
)

_EDGES = {(e.source, e.target): e for e in TRANSITIONS}


def _entered_once() -> frozenset[RunState]:
    """The states on no cycle of the table: a run enters each of them at
    most once in its life."""
    following: dict[RunState, set[RunState]] = {}
    for e in TRANSITIONS:
        following.setdefault(e.source, set()).add(e.target)

    def reaches(start: RunState, goal: RunState) -> bool:
        seen, todo = set(), list(following.get(start, ()))
        while todo:
            state = todo.pop()
            if state == goal:
                return True
            if state not in seen:
                seen.add(state)
                todo.extend(following.get(state, ()))
        return False

    return frozenset(state for state in RunState if not reaches(state, state))


# A copy of a run read in one of these states, outside its row lock, can be
# stale only by the run having moved on: its state never comes back (unlike
# TRACING, which the sweeper can leave and re-enter with another cause).
ENTERED_ONCE = _entered_once()


def edge(source: str, target: str) -> Edge | None:
    return _EDGES.get((source, target))


def sources_into(target: RunState, *, include_sweeper_only: bool = False) -> list[str]:
    """Sources of the edges into ``target`` (read by the @transition declarations)."""
    return [
        e.source.value
        for e in TRANSITIONS
        if e.target == target and (include_sweeper_only or not e.sweeper_only)
    ]


def is_legal(source: str, target: str, *, closing_cause: str | None = None, forced_by: str | None = None) -> bool:
    found = edge(source, target)
    if found is None:
        return False
    if found.sweeper_only and forced_by != ZOMBIE_SWEEPER:
        return False
    if source == S.TRACING and target in FINAL:
        return FINAL_STATE_FOR_CAUSE.get(closing_cause) == target
    return True


def job_status_for(state: str) -> str:
    """The legacy Job.status projection of a run state
    (docs/state-machine.md#job-status-projection)."""
    if state in {S.CREATED, S.PREPARING, S.PLANNING, S.POLICY_CHECK}:
        return "pending"
    if state == S.SUCCEEDED:
        return "done"
    if state in FINAL:
        return "failed"
    return "running"


def display_group(state: str) -> str:
    """The colour a page shows ``state`` in: the main path, waiting for a
    human, on the way out (transient states and TRACING), or one colour per
    final state."""
    if state == S.AWAITING_HITL:
        return "waiting"
    if state in MAIN_PATH:
        return "main"
    if state in FINAL:
        return state.lower().replace("_", "-")  # succeeded, closed-rejected, closed-failed, closed-cancelled
    return "transient"
