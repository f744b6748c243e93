"""The HITL controller: a human decision on a run that awaits approval.

The decision is stored (HITLDecisionTrace + AuditLog naming the approver)
and committed before the state machine is driven, so a decision that loses
a race (the run was cancelled or expired meanwhile) is still on record.
"""

from django.db import transaction
from django.utils import timezone

from runs.audit import audit
from runs.closing import run_close
from runs.dispatch import enqueue_advance
from runs.errors import ConflictError, ErrorCode, ExecGoError
from runs.models import AuditEvent, Run, Trace, TraceKind
from runs.statemachine import RunState
from runs.transitions import TransitionLost, run_transition

S = RunState
APPROVERS_GROUP = "approvers"


def may_decide(user, run: Run) -> bool:
    membership = getattr(user, "membership", None)
    return bool(
        getattr(user, "is_authenticated", False)
        and user.groups.filter(name=APPROVERS_GROUP).exists()
        and membership is not None
        and membership.tenant_id == run.tenant_id
        and user.pk != run.submitted_by_id  # separation of duties
    )


def run_decide(*, run: Run, approve: bool, actor, comment: str = "") -> Run:
    if not may_decide(actor, run):
        raise ExecGoError(ErrorCode.DENIED, "you may not decide on this run", source="approval",
                          details={"run": run.pk})
    decision = "approve" if approve else "reject"
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        if locked.state != S.AWAITING_HITL or Trace.objects.filter(run=locked, kind=TraceKind.HITL_DECISION).exists():
            audit(AuditEvent.APPROVAL_REFUSED, run_id=locked.pk, tenant_id=locked.tenant_id, actor=actor,
                  caller="hitl controller", from_state=locked.state,
                  data={"decision": decision, "reason": "already decided or not awaiting"})
            raise ConflictError(ErrorCode.INVALID_INPUT, f"run {run.pk} is {locked.state}; no decision is pending",
                                source="approval", details={"state": locked.state})
        data = {"decision": decision, "approver": actor.pk, "approver_name": actor.get_username(),
                "comment": comment, "timeout": False, "decided_at": timezone.now().isoformat()}
        Trace.objects.create(run=locked, kind=TraceKind.HITL_DECISION, from_state=S.AWAITING_HITL, data=data)
        audit(AuditEvent.APPROVAL_APPROVED if approve else AuditEvent.APPROVAL_REJECTED, run_id=locked.pk,
              tenant_id=locked.tenant_id, actor=actor, caller="hitl controller", from_state=S.AWAITING_HITL,
              data={"comment": comment})
    try:
        run = run_transition(run, S.EXECUTING if approve else S.REJECTED, actor=actor, expected=S.AWAITING_HITL,
                             data={"decision": decision})
    except TransitionLost:
        return Run.objects.get(pk=run.pk)
    if approve:
        enqueue_advance(run.pk)
    else:
        run = run_close(run.pk)
    return run
