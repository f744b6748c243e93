"""PLANNING: turn a run's request into a validated plan.

``static`` (default) takes the agent's plan as it is; ``llm`` asks an
OpenAI-compatible chat-completions endpoint to turn the run's goal into a
plan in the same schema. Both end in ``validate_plan``.
"""

from dataclasses import dataclass, field

from runs.errors import ExecGoError
from runs.models import Run
from runs.plans import validate_plan


@dataclass
class PlanningFailed(Exception):
    """The planner could not produce a valid plan; ``timed_out`` selects
    the TIMEOUT edge instead of FAILED."""

    envelope: dict
    timed_out: bool = False
    trace_data: dict = field(default_factory=dict)


def plan_run(run: Run) -> tuple[list[dict], dict]:
    """Return (normalised steps in dependency order, trace data)."""
    try:
        return validate_plan(run.plan), {"planner": "static"}
    except ExecGoError as exc:
        raise PlanningFailed(exc.envelope, trace_data={"planner": "static"}) from None
