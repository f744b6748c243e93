"""Writes that agents and users trigger: submit, cancel, retry.

The API, the admin and the dashboard call these; none of them writes a run
on its own.
"""

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from runs.audit import audit, user_or_none
from runs.closing import run_cancel_awaiting_approval
from runs.dispatch import enqueue_advance, enqueue_settle
from runs.errors import ConflictError, ErrorCode
from runs.models import AuditEvent, Job, Run, Tenant
from runs.plan_schema import validate_plan
from runs.statemachine import TRANSIENT, ClosingCause, RunState
from runs.transitions import lock_run, record_state, recorded_at_the_end
from runtime import statements

S = RunState


@dataclass(frozen=True)
class Submission:
    run: Run
    created: bool  # False when an Idempotency-Key matched an earlier run


def _create_run(*, job: Job, tenant: Tenant, user: Any, title: str, planner: str, plan: dict, goal: str,
                timeout_s: int, approval_timeout_s: int, idempotency_key: str | None = None,
                idempotency_fingerprint: str = "", retry_of: Run | None = None, callback_url: str = "",
                callback_events: list[str] | None = None) -> Run:
    now = timezone.now()
    run = Run.objects.create(
        job=job, tenant=tenant, submitted_by=user, title=title, planner=planner, plan=plan, submitted_plan=plan,
        goal=goal,
        timeout_s=timeout_s,
        approval_timeout_s=approval_timeout_s, idempotency_key=idempotency_key, retry_of=retry_of,
        idempotency_fingerprint=idempotency_fingerprint, callback_url=callback_url,
        callback_events=callback_events or [], last_state_change_at=now,
    )
    statements.update(Job, {"id": job.pk}, {"latest_run_id": run.pk})  # the projector follows the latest run
    record_state(run, None, S.CREATED, now, event=AuditEvent.RUN_CREATED, caller="api", actor=user,
                 message="run created", data={"retry_of": retry_of.pk if retry_of else None})
    # The worker must see the committed run: sent only after commit.
    enqueue_advance(run.pk, durable=True)
    return run


def run_submit(*, tenant: Tenant, user: Any, plan: dict | None = None, title: str = "", planner: str = "static",
               goal: str = "", timeout_s: int | None = None, approval_timeout_s: int | None = None,
               idempotency_key: str | None = None, callback_url: str = "",
               callback_events: list[str] | None = None) -> Submission:
    """A new run, or with an ``idempotency_key`` the run that key already
    made for the same request (another request body with it is a 409)."""
    if planner == "static":
        validate_plan(plan)
    callback_events = list(dict.fromkeys(callback_events or (["final"] if callback_url else [])))
    fingerprint = _fingerprint(plan=plan, title=title, planner=planner, goal=goal, timeout_s=timeout_s,
                               approval_timeout_s=approval_timeout_s, callback_url=callback_url,
                               callback_events=callback_events) if idempotency_key else ""
    if idempotency_key:
        existing = Run.objects.filter(tenant=tenant, idempotency_key=idempotency_key).first()
        if existing is not None:
            return _replayed(existing, fingerprint)
    try:
        with transaction.atomic(), recorded_at_the_end():
            job = Job.objects.create(tenant=tenant, title=title, created_by=user)
            run = _create_run(
                job=job, tenant=tenant, user=user, title=title, planner=planner, plan=plan or {}, goal=goal,
                timeout_s=timeout_s or settings.EXECGO_RUN_TIMEOUT_S,
                approval_timeout_s=approval_timeout_s or settings.EXECGO_APPROVAL_TIMEOUT_S,
                idempotency_key=idempotency_key or None, idempotency_fingerprint=fingerprint,
                callback_url=callback_url, callback_events=callback_events,
            )
    except IntegrityError:
        # Two requests with one Idempotency-Key raced; the other one won.
        existing = Run.objects.filter(tenant=tenant, idempotency_key=idempotency_key).first()
        if existing is None:
            raise
        return _replayed(existing, fingerprint)
    return Submission(run, created=True)


def _fingerprint(**request: Any) -> str:
    return hashlib.sha256(json.dumps(request, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def _replayed(existing: Run, fingerprint: str) -> Submission:
    if existing.idempotency_fingerprint and existing.idempotency_fingerprint != fingerprint:
        raise ConflictError(ErrorCode.INVALID_INPUT, "this Idempotency-Key was used with another request body",
                            source="api", details={"run": existing.pk})
    return Submission(existing, created=False)


def run_cancel(*, run: Run, user: Any, caller: str = "api") -> Run:
    """Store a cancel request, deciding under the run's row lock, and apply
    it now if the run sits at a state with a CANCELLED edge and nobody else
    is driving it (AWAITING_HITL). A run that is executing sees the request
    from its own worker; earlier states carry it to the first state with a
    CANCELLED edge.

    ``run`` is the caller's copy, possibly stale: the decision is taken on
    the locked row. A run that is final, or whose ending is already decided
    (TRACING, or a transient state other than CANCELLED), refuses the cancel
    with a 409 and nothing is written to it but one AuditLog row:
    ``cancel_refused`` when the caller already saw it final,
    ``cancel_superseded`` when it ended (or began to end) while the request
    was on its way. Returns the run as it was when the request was stored,
    or as the cancel left it (AWAITING_HITL)."""
    with transaction.atomic():
        lock_run(run.pk)
        # Under the lock the run cannot move until this transaction ends, so
        # this copy is the state the decision below is taken on (runs are
        # never deleted).
        current = Run.objects.select_related("cancel_requested_by").get(pk=run.pk)
        refusal = _cancel_refusal(current, seen_final=run.is_final)
        if refusal is None:
            if current.cancel_requested_at is None:
                current.cancel_requested_at, current.cancel_requested_by = timezone.now(), user_or_none(user)
                Run.objects.filter(pk=run.pk).update(cancel_requested_at=current.cancel_requested_at,
                                                     cancel_requested_by=current.cancel_requested_by)
            audit(AuditEvent.CANCEL_REQUESTED, run_id=run.pk, tenant_id=current.tenant_id, actor=user,
                  caller=caller, from_state=current.state)
        else:
            event, reason = refusal
            # Committed with this transaction, which writes nothing else: the
            # request is answered in the audit log, never silently dropped.
            audit(event, run_id=run.pk, tenant_id=current.tenant_id, actor=user, caller=caller,
                  from_state=current.state, data={"reason": reason, "closing_cause": current.closing_cause})
    if refusal is not None:
        raise ConflictError(ErrorCode.INVALID_INPUT, f"run {run.pk} is already {current.state}; {reason}",
                            source="api", details={"state": current.state,
                                                   "reason": "run_final" if current.is_final else "run_closing"})
    if current.state == S.EXECUTING:
        # The executing steps poll the flag; a run between steps (queued, or
        # waiting out a retry backoff) is settled by this task.
        enqueue_settle(run.pk, durable=True)
    elif current.state == S.AWAITING_HITL:
        return run_cancel_awaiting_approval(run.pk) or current
    return current


def cancel_would_apply(run: Run) -> bool:
    """Whether a cancel of ``run`` (as read) would be stored: the action to
    offer. The decision itself is taken under the lock by ``run_cancel``."""
    return _cancel_refusal(run, seen_final=True) is None


def _cancel_refusal(run: Run, *, seen_final: bool) -> tuple[AuditEvent, str] | None:
    """Why a cancel cannot apply to the locked ``run``, or None when it can
    (a run on its main path, or one already being cancelled)."""
    if run.is_final:
        if seen_final:
            return AuditEvent.CANCEL_REFUSED, "nothing to cancel"
        return AuditEvent.CANCEL_SUPERSEDED, "it ended before the cancel could be stored"
    if run.state == S.TRACING:
        decided = run.closing_cause != ClosingCause.CANCELLED
    else:
        decided = run.state in TRANSIENT and run.state != S.CANCELLED
    if decided:
        return AuditEvent.CANCEL_SUPERSEDED, "its ending was decided before the cancel could be stored"
    return None


def run_retry(*, run: Run, user: Any) -> Run:
    """A new run of the same plan on the same job; a run is never reopened."""
    if not run.is_final:
        raise ConflictError(ErrorCode.INVALID_INPUT, f"run {run.pk} is {run.state}; only a final run can be retried",
                            source="api", details={"state": run.state})
    with transaction.atomic():
        return _create_run(
            job=run.job, tenant=run.tenant, user=user, title=run.title, planner=run.planner,
            plan=run.plan if run.planner == "static" else {}, goal=run.goal, timeout_s=run.timeout_s,
            approval_timeout_s=run.approval_timeout_s, retry_of=run, callback_url=run.callback_url,
            callback_events=run.callback_events,
        )
