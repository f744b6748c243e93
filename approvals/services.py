"""The one decision service: the pages, the API and the admin all call
``approval_decide``; ``approval_expire`` is the expiry at the minute.

A decision is checked (who may decide, the request still pending, the
action unchanged), then recorded — Decision row, HITLDecisionTrace and
AuditLog, committed — and only then drives the state machine. A decision
that loses a race (the run was cancelled or expired meanwhile) is still on
record.

A request reaching a final status (approved, rejected, expired, voided)
also records the ``approval.decided`` webhook, in the transaction that
writes the status, when EXECGO_APPROVAL_WEBHOOK_URL and a secret are set.
"""

from dataclasses import dataclass

from django.db import transaction
from django.utils import timezone

from approvals.edits import apply_edit, edited_steps, rate_edit
from approvals.grants import grant_refusal, grants_create
from approvals.lifecycle import ApprovalStatus, request_finish
from approvals.models import (
    AGENTS_GROUP,
    APPROVERS_GROUP,
    ApprovalRequest,
    Decision,
    DecisionKind,
    NotificationKind,
    action_digest,
)
from approvals.notify import notify_request, told_of
from policy.interface import current_policy_version
from runs.audit import audit
from runs.closing import run_close
from runs.dispatch import enqueue_advance
from runs.errors import ConflictError, DeniedError, ErrorCode, ExecGoError, error_envelope
from runs.metrics import count_approval_decision
from runs.models import AuditEvent, Run, Step, Trace, TraceKind
from runs.selectors import tenant_of
from runs.statemachine import RunState
from runs.transitions import TraceRecord, TransitionLost, lock_run, run_transition

S = RunState


@dataclass(frozen=True)
class Outcome:
    request: ApprovalRequest
    approvals: int  # approvals so far (the quorum is request.approvals_required)


def may_decide(user, request: ApprovalRequest) -> str | None:
    """Why ``user`` may not decide ``request``, or None when they may."""
    if not getattr(user, "is_authenticated", False):
        return "sign in to decide"
    groups = set(user.groups.values_list("name", flat=True))
    if AGENTS_GROUP in groups:
        return "an agent identity never decides an approval"
    escalated_to = request.escalated_at is not None and request.tenant.approval_escalation_group in groups
    if APPROVERS_GROUP not in groups and not escalated_to:
        return "only members of the approvers group (or, once it escalated, of its escalation group) decide it"
    tenant = tenant_of(user)
    if tenant is None or tenant.pk != request.tenant_id:
        return "this request belongs to another tenant"
    if user.pk == request.run.submitted_by_id:
        return "the identity that submitted a run may not approve it (separation of duties)"
    return None


STALE_VIEW = "the plan changed since you opened it: reload"
REASON_NEEDED = "A rejection needs a reason."


def approval_decide(*, request: ApprovalRequest, actor, approve: bool, digest: str, comment: str = "",
                    edits: dict[str, dict] | None = None, grant_hours: int | None = None) -> Outcome:
    """``digest``: the action digest of the view the decision was made on (a
    page's hidden field, the API's ``digest``); one that is no longer the
    request's is refused as ``stale_view``, audited, and nothing recorded.
    ``edits`` ({step id: {param: value}}): approve with edits (see
    approvals/edits.py); allowed with the first decision only, since other
    approvers approved the plan as it stands. ``grant_hours``: approve, and allow
    the same high-risk actions of the same agent again without asking for
    that many hours (``approvals.grants``)."""
    decision = DecisionKind.APPROVE if approve else DecisionKind.REJECT
    reason = may_decide(actor, request)
    if reason is not None:
        raise DeniedError(ErrorCode.DENIED, reason, source="approval", details={"request": request.pk})
    if grant_hours is not None and (refusal := grant_refusal(request, grant_hours, approve=approve, edits=edits)):
        raise ExecGoError(ErrorCode.INVALID_INPUT, refusal, source="approval",
                          details={"request": request.pk, "fields": {"grant_hours": [refusal]}})

    approvals = 0
    with transaction.atomic():
        lock_run(request.run_id)  # the run first, as everywhere
        locked = ApprovalRequest.objects.select_for_update().get(pk=request.pk)
        now = timezone.now()
        verdict = _judge(locked, actor, approve=approve, digest=digest, comment=comment, edits=edits, now=now)
        if verdict.voided:
            request_finish(locked, ApprovalStatus.VOIDED, now=now, decided_by=actor, reason=verdict.voided)
            audit(AuditEvent.APPROVAL_VOIDED, run_id=locked.run_id, tenant_id=locked.tenant_id, actor=actor,
                  caller="hitl controller", from_state=S.AWAITING_HITL,
                  data={"request": locked.pk, "reason": verdict.voided})
        elif not verdict.refused and not verdict.needs_reason:
            approvals = _record(locked, actor, decision, comment, now, edits=edits)
            if grant_hours is not None and locked.status == ApprovalStatus.APPROVED:
                grants_create(locked, actor, grant_hours, now=now)
    if verdict.needs_reason:
        raise ExecGoError(ErrorCode.INVALID_INPUT, REASON_NEEDED, source="approval",
                          details={"request": locked.pk, "fields": {"comment": [REASON_NEEDED]}})
    if verdict.refused:
        _refuse(locked, actor, decision, verdict.refused, stale_digest=str(digest)[:64] if verdict.stale else None)
    if verdict.voided:
        _close(locked, actor, S.REJECTED, {"decision": "void", "request": locked.pk})
        raise ConflictError(ErrorCode.INVALID_INPUT, f"approval voided: {verdict.voided}", source="approval",
                            details={"request": locked.pk, "status": ApprovalStatus.VOIDED})
    if locked.status != ApprovalStatus.PENDING:  # decided: those told of the request are told of the outcome
        with transaction.atomic():
            notify_request(locked, NotificationKind.DECIDED, recipients=told_of(locked))
    _take_effect(locked, actor)  # recorded and committed: only now does the decision take effect
    count_approval_decision(locked)
    return Outcome(request=locked, approvals=approvals)


@dataclass(frozen=True)
class _Verdict:
    """What the rules of a decision say of one (all empty: record it)."""

    refused: str | None = None  # not recorded: why
    voided: str | None = None  # the request is void: why
    stale: bool = False  # refused because the view it was made on is not the request's now
    needs_reason: bool = False  # a rejection with no reason: not a decision at all


def _judge(locked: ApprovalRequest, actor, *, approve: bool, digest: str, comment: str,
           edits: dict[str, dict] | None, now) -> _Verdict:
    """The rules of a decision, checked in order under the run's and the
    request's locks; the first that fails decides. An edit that passes them
    is applied here (raising, and rolling back, when invalid or denied)."""
    if locked.status != ApprovalStatus.PENDING:
        return _Verdict(refused=f"this request is {locked.status}; nothing is pending")
    if now >= locked.expires_at:
        return _Verdict(refused="this request expired")
    if locked.decisions.filter(decider=actor).exists():
        return _Verdict(refused="you already decided this request")
    if digest != locked.action_digest:
        return _Verdict(refused=STALE_VIEW, stale=True)
    steps = list(Step.objects.filter(run_id=locked.run_id).order_by("position"))
    if action_digest(steps, locked.policy_version) != locked.action_digest:
        return _Verdict(voided="the plan changed since the approval was requested")
    if current_policy_version(locked.tenant_id) != locked.policy_version:
        return _Verdict(voided="the policy changed since the approval was requested")
    if not approve and not comment.strip():
        return _Verdict(needs_reason=True)
    if edits and locked.decisions.exists():
        return _Verdict(refused="edits come with the first decision: others approved the plan as it stands")
    if edits:
        run = Run.objects.get(pk=locked.run_id)
        edited = edited_steps(run, steps, edits)
        apply_edit(locked, run, steps, edited, rate_edit(run, edited), actor, now=now)
    return _Verdict()


def _refuse(locked: ApprovalRequest, actor, decision: str, refused: str, *, stale_digest: str | None) -> None:
    """Audit a refused decision and raise: after the transaction (which wrote
    nothing), so the row is kept on SQLite too."""
    stale = stale_digest is not None
    audit(AuditEvent.APPROVAL_STALE_VIEW if stale else AuditEvent.APPROVAL_REFUSED, run_id=locked.run_id,
          tenant_id=locked.tenant_id, actor=actor, caller="hitl controller", from_state=S.AWAITING_HITL,
          data={"request": locked.pk, "decision": decision, "reason": refused,
                **({"seen_digest": stale_digest, "digest": locked.action_digest} if stale else {})})
    raise ConflictError(ErrorCode.INVALID_INPUT, refused, source="approval",
                        details={"request": locked.pk, "status": locked.status,
                                 **({"reason": "stale_view", "digest": locked.action_digest} if stale else {})})


def _take_effect(locked: ApprovalRequest, actor) -> None:
    if locked.status == ApprovalStatus.APPROVED:
        try:
            run_transition(locked.run_id, S.EXECUTING, actor=actor, expected=S.AWAITING_HITL,
                           data={"decision": "approve", "request": locked.pk})
            enqueue_advance(locked.run_id, durable=True)
        except TransitionLost:
            pass  # cancelled meanwhile: the decision stays on record
    elif locked.status == ApprovalStatus.REJECTED:
        _close(locked, actor, S.REJECTED, {"decision": "reject", "request": locked.pk})


def _record(request: ApprovalRequest, actor, decision: str, comment: str, now, *, edits: dict | None) -> int:
    """The decision, its trace and its audit row, in the caller's
    transaction; the request's outcome once the quorum or a reject says so."""
    Decision.objects.create(request=request, decider=actor, decision=decision, comment=comment, edits=edits,
                            digest=request.action_digest)
    approvals = request.decisions.filter(decision=DecisionKind.APPROVE).count()
    final = decision == DecisionKind.REJECT or approvals >= request.approvals_required
    if final:
        request_finish(request, ApprovalStatus.APPROVED if decision == DecisionKind.APPROVE else ApprovalStatus.REJECTED,
                       now=now, decided_by=actor, comment=comment)
    Trace.objects.create(run_id=request.run_id, kind=TraceKind.HITL_DECISION, from_state=S.AWAITING_HITL, data={
        "decision": decision, "approver": actor.pk, "approver_name": actor.get_username(), "comment": comment,
        "timeout": False, "decided_at": now.isoformat(), "request": request.pk, "approvals": approvals,
        "digest": request.action_digest,
        "approvals_required": request.approvals_required, "final": final,
        **({"edits": edits, "edited_by": actor.get_username()} if edits else {}),
    })
    audit(AuditEvent.APPROVAL_APPROVED if decision == DecisionKind.APPROVE else AuditEvent.APPROVAL_REJECTED,
          run_id=request.run_id, tenant_id=request.tenant_id, actor=actor, caller="hitl controller",
          from_state=S.AWAITING_HITL, data={"request": request.pk, "comment": comment, "approvals": approvals,
                                            "digest": request.action_digest,
                                            "approvals_required": request.approvals_required,
                                            **({"edits": edits} if edits else {})})
    return approvals


def _close(request: ApprovalRequest, actor, target: RunState, data: dict) -> None:
    """A reject (or a voided approval: what it covered is not what would run) closes the run."""
    try:
        run_transition(request.run_id, target, actor=actor, expected=S.AWAITING_HITL, data=data)
    except TransitionLost:
        return
    run_close(request.run_id)


def approval_expire(request_id: int, *, now=None) -> bool:
    """At expires_at, a request nobody decided rejects its run (TIMEOUT →
    TRACING → CLOSED_REJECTED). False when it is not due or not pending."""
    now = now or timezone.now()
    with transaction.atomic():
        request = ApprovalRequest.objects.select_for_update().filter(pk=request_id).select_related("run").first()
        if request is None or request.status != ApprovalStatus.PENDING or now < request.expires_at:
            return False
        request_finish(request, ApprovalStatus.EXPIRED, now=now, reason="expired with no decision")
        notify_request(request, NotificationKind.EXPIRED, recipients=told_of(request))
        audit(AuditEvent.HITL_TIMEOUT, run_id=request.run_id, tenant_id=request.tenant_id,
              caller="hitl controller", from_state=S.AWAITING_HITL,
              data={"request": request.pk, "expires_at": request.expires_at.isoformat()})
    error = error_envelope(ErrorCode.TIMEOUT, f"approval request {request.pk} expired with no decision",
                           source="approval", retryable=False, details={"request": request.pk, "layer": "expiry"})
    try:
        run_transition(request.run_id, S.TIMEOUT, expected=S.AWAITING_HITL, message=error["message"],
                       data={"request": request.pk, "layer": "expiry"},
                       trace=TraceRecord(TraceKind.HITL_DECISION, {"decision": "reject", "timeout": True,
                                                                   "request": request.pk}, error=error))
    except TransitionLost:
        return True
    run_close(request.run_id)
    return True
