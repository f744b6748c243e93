"""What the API answers, as frozen dataclasses: a run, one of its events, a
policy evaluation, an approval request. Each keeps the JSON it came from
(``raw``), so a field the server adds later is not lost to a caller."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FINAL_STATES = frozenset({"SUCCEEDED", "CLOSED_REJECTED", "CLOSED_FAILED", "CLOSED_CANCELLED"})
NEEDS_HUMAN_STATES = frozenset({"AWAITING_HITL"})


@dataclass(frozen=True)
class Run:
    id: int
    state: str
    closing_cause: str
    title: str
    steps: list[dict[str, Any]]
    allowed_actions: dict[str, Any]
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Run:
        return cls(id=int(data["id"]), state=str(data.get("state", "")), closing_cause=data.get("closing_cause") or "",
                   title=data.get("title") or "", steps=list(data.get("steps") or []),
                   allowed_actions=dict(data.get("allowed_actions") or {}), raw=data)

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    @property
    def needs_human(self) -> bool:
        return self.state in NEEDS_HUMAN_STATES

    @property
    def reached(self) -> bool | None:
        """From ``wait``: whether the condition held before the server's timeout."""
        return self.raw.get("reached")

    @property
    def approval_page(self) -> str | None:
        """The approval page's path (``/approvals/<id>/``) while AWAITING_HITL."""
        return (self.allowed_actions.get("approval") or {}).get("page")

    @property
    def step_errors(self) -> list[tuple[str, dict[str, Any]]]:
        """(step id, error envelope body) of every step whose result is an error."""
        return [(str(step.get("id")), (step.get("result") or {})["error"]) for step in self.steps
                if (step.get("result") or {}).get("error")]


@dataclass(frozen=True)
class Event:
    """One outbox event of a run (``run_state_changed``, ``task_started``, ...)."""

    id: int | str | None
    type: str
    run_id: int | None
    task_id: str
    handle_id: str
    timestamp: str
    message: str
    data: dict[str, Any]
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, data: dict[str, Any], *, sse_id: str | None = None, sse_type: str = "") -> Event:
        event_id = data.get("id", sse_id)
        if isinstance(event_id, str) and event_id.isdigit():
            event_id = int(event_id)
        return cls(id=event_id, type=str(data.get("type") or sse_type or "message"), run_id=data.get("run_id"),
                   task_id=data.get("task_id") or "", handle_id=data.get("handle_id") or "",
                   timestamp=data.get("timestamp") or "", message=data.get("message") or "",
                   data=dict(data.get("data") or {}), raw=data)

    @property
    def final_state(self) -> bool:
        """The run entered a final state: the last event of its stream."""
        return self.type == "run_state_changed" and self.data.get("to") in FINAL_STATES


@dataclass(frozen=True)
class Evaluation:
    risk: str
    needs_human: bool
    rejected: bool
    policy_version: int | None
    steps: list[dict[str, Any]]
    matched_rules: list[Any]
    budget: dict[str, Any]
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Evaluation:
        return cls(risk=str(data.get("risk", "")), needs_human=bool(data.get("needs_human")),
                   rejected=bool(data.get("rejected")), policy_version=data.get("policy_version"),
                   steps=list(data.get("steps") or []), matched_rules=list(data.get("matched_rules") or []),
                   budget=dict(data.get("budget") or {}), raw=data)


@dataclass(frozen=True)
class Approval:
    id: int
    run_id: int | None
    status: str
    risk: str
    policy_version: int | None
    requested_at: str
    expires_at: str
    page_url: str
    steps: list[Any]
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Approval:
        return cls(id=int(data["id"]), run_id=data.get("run_id"), status=str(data.get("status", "")),
                   risk=str(data.get("risk", "")), policy_version=data.get("policy_version"),
                   requested_at=data.get("requested_at") or "", expires_at=data.get("expires_at") or "",
                   page_url=data.get("page_url") or "", steps=list(data.get("steps") or []), raw=data)
