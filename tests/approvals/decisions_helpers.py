"""Helpers of the decision service's tests (test_decisions*.py): the plan
they submit, a run's path, its pending request and audit rows, and the check
of a decision refused on a request that is not decidable any more."""

import pytest

from approvals.models import ApprovalRequest, Decision
from approvals.services import approval_decide
from runs.errors import ConflictError
from runs.models import AuditLog, Run, Step, Trace

PLAN = {"steps": [
    {"id": "prep", "tool": "shell", "params": {"argv": ["echo", "ready"]}},
    {"id": "install", "tool": "shell", "params": {"argv": ["pip", "install", "requests"]}, "depends_on": ["prep"]},
]}
APPROVAL_TIMEOUT_S = 900


def path_of(run: Run) -> list[str]:
    return list(Trace.objects.filter(run_id=run.pk, kind="transition").values_list("to_state", flat=True))


def pending_request(run: Run) -> ApprovalRequest:
    return ApprovalRequest.objects.get(run_id=run.pk, status="pending")


def fresh(obj):
    obj.refresh_from_db()
    return obj


def audit_events(run: Run, event: str):
    return AuditLog.objects.filter(run_id=run.pk, event=event)


def assert_no_step_started(run: Run) -> None:
    steps = list(Step.objects.filter(run_id=run.pk))
    assert steps, "the run has steps"
    for step in steps:
        assert step.status in ("pending", "skipped"), (step.step_id, step.status)
        assert step.run_status not in ("accepted", "running", "success"), (step.step_id, step.run_status)
        assert step.attempt == 0 and step.started_at is None, step.step_id


def assert_refused(request: ApprovalRequest, actor, *, approve: bool, status: str, reason: str) -> None:
    """A decision on a request that is not decidable any more: 409, nothing
    recorded but the ``approval_refused`` row, which outlives the call."""
    decisions = Decision.objects.filter(request_id=request.pk).count()
    refusals = AuditLog.objects.filter(run_id=request.run_id, event="approval_refused").count()
    with pytest.raises(ConflictError) as refused:
        approval_decide(request=request, digest=request.action_digest, actor=actor, approve=approve, comment="too late")
    assert refused.value.http_status == 409
    assert refused.value.envelope["code"] == "invalid_input"
    assert refused.value.envelope["details"] == {"request": request.pk, "status": status}
    assert reason in refused.value.envelope["message"]
    assert Decision.objects.filter(request_id=request.pk).count() == decisions
    rows = list(AuditLog.objects.filter(run_id=request.run_id, event="approval_refused").order_by("id"))
    assert len(rows) == refusals + 1
    assert rows[-1].actor_id == actor.pk
    assert rows[-1].data["request"] == request.pk
    assert rows[-1].data["decision"] == ("approve" if approve else "reject")
    assert reason in rows[-1].data["reason"]
