"""EXECUTING: one attempt of a step on this host, and its result
(docs/stages.md#executing). What runs next is settle's (``runs.settle``);
a step's moves are ``runs.step_lifecycle``'s.

``step_execute`` claims one accepted attempt (its slot reserved first, or
back to the queue) and runs it; ``step_finish`` writes its result fenced by
the attempt number (a late result of a superseded attempt is audited and
dropped) and, in the same transaction, queues a retry or settles the run.

Between two steps of a sequential plan a worker commits one transaction:
the result, the next step started, the slot handed over and their events;
meanwhile the fork server forks the next step's shim (a spare, started once
that transaction has committed, closed unused if no step follows here).
That next step is forecast before the transaction (``runs.settle.Forecast``):
its handle and plan are fixed then, so the spare can also set up its
sandbox meanwhile (``runtime.shim_prestart.Prestart``); the shim runs the
command there only if the step's request turns out to be exactly the one
forecast.

The module stays a little over 400 lines: an attempt's claim, launch and
fenced finish share their fences and are read together.
"""

import logging
import random
import time
from dataclasses import replace
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from structlog.contextvars import bind_contextvars

from runs.audit import audit
from runs.closing import run_close
from runs.dataplane import (
    HOST_SEEN_WITHIN_S,
    current_host,
    host_capabilities,
    new_handle_id,
    plan_needs,
    queue_for,
    read_result,
    reattach,
    release_reservation,
    reserve_slot,
    resolve_step_plan,
    run_tool,
    wait_for_slot,
    warm_shim,
    weaker_than_rated,
)
from runs.dispatch import Claim, enqueue_claims
from runs.errors import ErrorCode, error_envelope
from runs.ledger_heal import ledger_heal
from runs.metrics import count_step_end
from runs.models import AuditEvent, EventType, Run, Step, StepRunStatus, StepStatus
from runs.outbox import emit, emit_step_event, step_event
from runs.settle import Forecast, arm_timer_if_executing, close_unused, forecast_next, settle_locked
from runs.statemachine import RunState
from runs.step_lifecycle import step_set
from runs.steps import unstarted_result
from runs.transitions import lock_run, recorded_at_the_end
from runtime.envelopes import EnvelopeError
from runtime.forkserver import ShimLink
from runtime.models import HostCapacity

S = RunState
logger = logging.getLogger(__name__)

CANCEL_POLL_S = 0.1
MAX_BACKOFF_S = 30.0


def hand_to_capable_host(step: Step, attempt: int) -> bool:
    """Send ``step``'s attempt to the queue of the hosts that can honour its
    rated plan, when another such host has been seen lately; False when none
    has (the caller then refuses the step)."""
    needs = plan_needs(step.rated_plan)
    recent = timezone.now() - timedelta(seconds=HOST_SEEN_WITHIN_S)
    others = HostCapacity.objects.filter(last_seen__gte=recent).exclude(host=current_host())
    if not any(needs <= host_capabilities(row.capabilities or {}) for row in others):
        return False
    logger.warning("step %s: this host would run it weaker than rated; handed to %s", step.pk, queue_for(step))
    enqueue_claims([Claim(step.pk, attempt, queue_for(step))], countdown=1.0)
    return True


def step_execute(step_pk: int, attempt: int, *, started: Step | None = None, steps: list[Step] | None = None,
                 spare: ShimLink | None = None) -> Claim | None:
    """Run one attempt of a step to its end on this host; return the next
    step attempt this worker should run itself, if any. ``started``,
    ``reserved``, ``steps`` and ``spare`` come from the claim settle made
    for this worker (see ``Claim``)."""
    try:
        return _step_execute(step_pk, attempt, started=started, steps=steps, spare=spare)
    finally:
        if spare is not None:
            spare.close()  # spent by the step, or unused: a spare exits when its link closes


def _step_execute(step_pk: int, attempt: int, *, started: Step | None, steps: list[Step] | None,
                  spare: ShimLink | None) -> Claim | None:
    plan_error, held = None, started is not None  # a started claim holds its slot (``_dispatch``)
    ahead: list[tuple[ShimLink | None, Forecast | None]] = []
    if started is None:
        claimed = _claim(step_pk, attempt)
        if claimed is None:
            return None
        step, held, plan_error = claimed
    else:
        step = started
    run = step.run
    bind_contextvars(run_id=run.pk, tenant_id=run.tenant_id, step_id=step.step_id, handle_id=step.handle_id)
    try:
        if plan_error is not None:
            result = unstarted_result(step, attempt, step.started_at, plan_error)
        elif run.state != S.EXECUTING:
            result = unstarted_result(step, attempt, step.started_at,
                                      error_envelope(ErrorCode.CANCELLED, f"run is {run.state}", source="scheduler"))
        elif not held:  # the run's deadline passed before the attempt got a slot: nothing runs without one
            result = unstarted_result(step, attempt, step.started_at,
                                      error_envelope(ErrorCode.TIMEOUT, "the run's deadline passed before the step "
                                                     "started", source="scheduler"))
        else:
            remaining = (run.deadline - timezone.now()).total_seconds()
            result = run_tool(
                step, attempt=attempt, timeout_s=max(min(step.timeout_s, remaining), 0.001),
                cancel_requested=_cancel_poller(run.pk),
                on_progress=lambda percent, message: record_progress(run.pk, step, attempt, percent, message),
                spare=spare,
                # While it runs, the step that most likely follows here is made ready to start.
                while_running=(lambda: ahead.append(_warm_following(step, steps))) if steps is not None else None,
            )
    except BaseException:
        release_reservation(step.handle_id)
        _close_spares(ahead)
        raise
    if result is None:  # still running: this worker's watcher has it now (``runs.step_watch``)
        _close_spares(ahead)
        return None
    return step_finish(step, attempt, result, steps=steps, ahead=ahead[0] if ahead else None)


def _close_spares(ahead: list[tuple[ShimLink | None, Forecast | None]]) -> None:
    for following_spare, forecast in ahead:
        close_unused(following_spare, forecast)  # the step's end was not recorded here: nor was the forecast


def _claim(step_pk: int, attempt: int) -> tuple[Step, bool, dict | None] | None:
    """Claim the accepted ``attempt`` for this process: its effective plan
    resolved and checked against the rated one, its slot held (``held``)
    while the run may still run it, else the refusal (``plan_error``) it is
    to be ended with unstarted. None when there is nothing to run here:
    gone, a duplicate delivery, cancelled or superseded, handed to another
    host or back in the queue."""
    fenced = {} if settings.EXECGO_TEST_SKIP_FENCING else {"run_status": StepRunStatus.ACCEPTED}
    step = Step.objects.select_related("run").filter(pk=step_pk, attempt=attempt, **fenced).first()
    if step is None:
        return None  # gone, a duplicate delivery, or the attempt was cancelled or superseded
    plan_error, held = None, False
    try:
        step.effective_plan = resolve_step_plan(step)
    except EnvelopeError as exc:  # strict request this host cannot honour: refused before anything runs
        step.effective_plan, plan_error = {}, exc.envelope
    if plan_error is None and (weaker := weaker_than_rated(step.effective_plan, step.rated_plan)):
        # Never weaker than what was rated (and maybe approved): another host, or not at all.
        if step.run.state == S.EXECUTING and timezone.now() < step.run.deadline and hand_to_capable_host(
                step, attempt):
            return None
        plan_error = error_envelope(
            ErrorCode.DENIED, f"this host would run the step weaker than the plan it was rated on "
            f"({'; '.join(weaker)}) and no other host that can honour that plan is up", source="executor",
            details={"weaker": weaker, "needs": sorted(plan_needs(step.rated_plan)), "host": current_host()})
    if plan_error is None and step.run.state == S.EXECUTING and timezone.now() < step.run.deadline:
        held, plan_error = _hold_slot(step, attempt)
        if not held and plan_error is None:
            return None  # back in the queue
    # Not held otherwise: the attempt is claimed to be ended unstarted.
    try:
        with transaction.atomic():
            claimed = step_set(step, expect=(step.status, StepRunStatus.ACCEPTED),
                               to=(StepStatus.RUNNING, StepRunStatus.RUNNING), where={"attempt": attempt},
                               started_at=timezone.now(), host=current_host(), effective_plan=step.effective_plan)
            if claimed:
                emit_step_event(step.run_id, step, EventType.TASK_STARTED, "started",
                                {"attempt": attempt, "host": step.host, "plan": step.effective_plan})
    except BaseException:
        release_reservation(step.handle_id, only_mine=True)
        raise
    if not claimed and not settings.EXECGO_TEST_SKIP_FENCING:
        # Lost the claim to a duplicate delivery or a cancel: give back
        # only a slot this process took (never the winner's).
        release_reservation(step.handle_id, only_mine=True)
        return None
    return step, held, plan_error


def _hold_slot(step: Step, attempt: int) -> tuple[bool, dict | None]:
    """Reserve the step's slot before its attempt is claimed: at once, or
    after giving back the slots of dead worker processes, or within
    EXECGO_LEDGER_WAIT_S. Otherwise the attempt goes back to the queue
    (still accepted) rather than hold this pool process, which also runs
    deadline timers and the sweeper. Returns (held, refusal): a refusal is
    the envelope of a step that can never fit this host."""
    if reserve_slot(step):
        return True, None
    if ledger_heal() and reserve_slot(step):
        return True, None
    while True:
        try:
            wait_for_slot(step)
            return True, None
        except EnvelopeError as exc:
            if exc.envelope["code"] != ErrorCode.TIMEOUT:
                return False, exc.envelope
            waited_ms = (exc.envelope.get("details") or {}).get("waited_ms")
        # Eager mode runs a re-queued task inline, at once: it would recurse
        # instead of giving the slot holders time. There this process is the
        # only executor, so it waits on, until the run's deadline.
        if not settings.CELERY_TASK_ALWAYS_EAGER or timezone.now() >= step.run.deadline:
            break
    _requeue(step, attempt, waited_ms=waited_ms)
    return False, None


def _requeue(step: Step, attempt: int, *, waited_ms: int | None) -> None:
    # Jittered: steps that found the host full together do not come back in lockstep.
    countdown = round(settings.EXECGO_LEDGER_REQUEUE_S * random.uniform(0.5, 1.5), 3)
    with transaction.atomic():
        emit_step_event(step.run_id, step, EventType.TASK_PROGRESSED,
                        f"no free slot on {current_host()}: back to the queue for {countdown}s",
                        {"attempt": attempt, "waiting_for": "resources", "requeued": True, "countdown_s": countdown,
                         "waited_ms": waited_ms})
        enqueue_claims([Claim(step.pk, attempt, queue_for(step))], countdown=countdown)


def step_reattach(step_pk: int, attempt: int) -> Claim | None:
    """After a worker restart: wait for the shim the dead worker started
    and ingest its result (or the failure of a shim that is gone)."""
    step = Step.objects.select_related("run").filter(pk=step_pk, attempt=attempt,
                                                     run_status=StepRunStatus.RUNNING).first()
    if step is None:
        return None
    bind_contextvars(run_id=step.run_id, tenant_id=step.run.tenant_id, step_id=step.step_id, handle_id=step.handle_id)
    # Adopt the slot the dead worker held (kept for the shim by recovery),
    # or take a free one; a full host does not delay ingesting the result.
    reserve_slot(step)
    result = reattach(step, cancel_requested=_cancel_poller(step.run_id),
                      on_progress=lambda percent, message: record_progress(step.run_id, step, attempt, percent,
                                                                           message))
    audit(AuditEvent.STEP_REATTACHED, run_id=step.run_id, tenant_id=step.run.tenant_id, caller="recovery",
          data={"step": step.step_id, "attempt": attempt, "handle_id": step.handle_id,
                "status": StepRunStatus.RUNNING if result is None else result["status"]})
    if result is None:  # still running: handed to this worker's watcher
        return None
    return step_finish(step, attempt, result)


def step_watched_end(step_pk: int, attempt: int) -> Claim | None:
    """A step attempt handed to the watcher has ended (its report,
    ``runs.step_watch``): its result is recorded like any other's."""
    step = Step.objects.select_related("run").filter(pk=step_pk, attempt=attempt).first()
    if step is None:
        return None  # retried meanwhile: that attempt's own result is the one that counts
    bind_contextvars(run_id=step.run_id, tenant_id=step.run.tenant_id, step_id=step.step_id, handle_id=step.handle_id)
    result = read_result(step)
    if result is None:  # the watcher always leaves one; waited for all the same rather than guessed
        return step_reattach(step_pk, attempt)
    if step.result == result:
        # A duplicate report: this result is recorded. Its slot is given back again in case the
        # first recording died between its commit and its release (a release is idempotent).
        release_reservation(step.handle_id)
        return None
    # Fenced: a result that comes after the sweeper or a cancel closed the
    # step is audited as stale, as a pool process's would be.
    return step_finish(step, attempt, result)


def step_finish(step: Step, attempt: int, result: dict, *, steps: list[Step] | None = None,
                ahead: tuple[ShimLink | None, Forecast | None] | None = None) -> Claim | None:
    """Apply one attempt's result, fenced by the attempt, and in the same
    transaction schedule a retry or settle the run (under the run's row
    lock, taken first: the same lock order as the sweeper and close).
    ``steps``: the run's steps, known when this attempt was the only one in
    flight (``Claim.steps``); used only when it succeeded. ``ahead``: what
    ``_warm_following`` made ready while the attempt ran."""
    spare, forecast = ahead or (None, None)
    if steps is None or result["status"] != StepRunStatus.SUCCESS:
        close_unused(spare, forecast)  # before the transaction: none names the forecast
        spare = forecast = None
    elif ahead is None:  # the step ran in this process (not in a shim): made ready now, during the transaction
        spare, forecast = _warm_following(step, steps)
    try:
        claim = _step_finish(step, attempt, result, steps=steps, forecast=forecast)
        if claim is not None and claim.started is not None:
            if spare is not None:  # a spare forecast for another step starts this one the usual way
                claim, spare = replace(claim, spare=spare), None
            if forecast is not None and claim.started.handle_id == forecast.handle_id:
                forecast = None  # its task directory is the started step's
        return claim
    finally:
        close_unused(spare, forecast, maybe_recorded=True)  # no step of this chain follows here


def _warm_following(step: Step, steps: list[Step]) -> tuple[ShimLink | None, Forecast | None]:
    """For a chain that most likely goes on here once ``step`` succeeded:
    a spare shim for the step that follows, forecast (see ``Forecast``) so
    that its sandbox is set up in the spare too; nothing when no step is
    pending."""
    if not any(other.status == StepStatus.PENDING and not other.run_status for other in steps):
        return None, None
    following, forecast = forecast_next(step, steps) or (None, None)
    if forecast is None:
        return warm_shim(step), None
    return warm_shim(step, following=following, handle_id=forecast.handle_id, plan=forecast.plan), forecast


def _step_finish(step: Step, attempt: int, result: dict, *, steps: list[Step] | None,
                 forecast: Forecast | None = None) -> Claim | None:
    run = step.run
    finished_handle = step.handle_id  # the retry below names the next attempt's handle
    error = result["error"]
    # An attempt that failed before anything ran costs the step none of its retries.
    never_started = bool(error) and (error.get("details") or {}).get("started") is False
    allowed = step.retries + (settings.EXECGO_UNSTARTED_RETRIES if never_started else 0)
    retry = (result["status"] == StepRunStatus.FAILED and error and error["retryable"]
             and attempt <= allowed and timezone.now() < run.deadline)
    status = StepStatus.SUCCESS if result["status"] == StepRunStatus.SUCCESS else StepStatus.FAILED
    with transaction.atomic(), recorded_at_the_end():
        locked = lock_run(run.pk)
        fenced = step_set(step, expect=(StepStatus.RUNNING, StepRunStatus.RUNNING),
                          to=(StepStatus.RUNNING if retry else status, result["status"]), where={"attempt": attempt},
                          result=result, finished_at=timezone.now(),
                          progress=100 if status == StepStatus.SUCCESS else None)
        if not fenced:
            audit(AuditEvent.STALE_RESULT_IGNORED, run_id=run.pk, tenant_id=run.tenant_id, caller="tool controller",
                  data={"step": step.step_id, "attempt": attempt, "status": result["status"]})
            transaction.on_commit(lambda: release_reservation(finished_handle))
            return None
        count_step_end(step.tool, result)
        event_type = {StepRunStatus.SUCCESS: EventType.TASK_SUCCEEDED,
                      StepRunStatus.CANCELLED: EventType.TASK_CANCELLED}.get(result["status"], EventType.TASK_FAILED)
        events = [step_event(run.pk, step, event_type, result["error"]["message"] if result["error"] else "succeeded",
                              {"attempt": attempt, "duration_ms": result["duration_ms"]})]
        if retry:
            backoff = min(0.2 * 2 ** (attempt - 1), MAX_BACKOFF_S)
            next_attempt = attempt + 1
            step.handle_id = new_handle_id(step, next_attempt)
            step_set(step, expect=(StepStatus.RUNNING, StepRunStatus.FAILED),
                     to=(StepStatus.RUNNING, StepRunStatus.ACCEPTED), where={"attempt": attempt},
                     attempt=next_attempt, handle_id=step.handle_id)
            events.append(step_event(run.pk, step, EventType.TASK_RETRIED,
                                      f"retrying in {backoff:.1f}s after attempt {attempt}",
                                      {"attempt": next_attempt, "backoff_s": backoff, "error": result["error"]}))
            emit(events)
            transaction.on_commit(lambda: release_reservation(finished_handle))
            enqueue_claims([Claim(step.pk, next_attempt, queue_for(step))], countdown=backoff)
            return None
        # ``step`` is one of ``steps`` (the claim's started step), as just written.
        known = steps if status == StepStatus.SUCCESS else None
        claim, close = settle_locked(locked, events, claim_one=True, handover=finished_handle, steps=known,
                                     forecast=forecast)
    if close:
        run_close(run.pk, tracing=locked)
    if claim is None or not claim.reserved:
        release_reservation(finished_handle)
    return claim


def _cancel_poller(run_id: int):
    """A cheap ``cancel_requested()`` for the executor: the database is
    asked at most every CANCEL_POLL_S, whatever the executor's poll rate."""
    last = {"at": 0.0, "value": False}

    def cancel_requested() -> bool:
        now = time.monotonic()
        if not last["value"] and now - last["at"] >= CANCEL_POLL_S:
            last["at"] = now
            last["value"] = Run.objects.filter(pk=run_id).exclude(
                cancel_requested_at=None, state=S.EXECUTING
            ).exists()
        return last["value"]

    return cancel_requested


def record_progress(run_id: int, step: Step, attempt: int, percent: int, message: str) -> None:
    with transaction.atomic():
        if Step.objects.filter(pk=step.pk, attempt=attempt, run_status=StepRunStatus.RUNNING).update(
            progress=percent
        ):
            emit_step_event(run_id, step, EventType.TASK_PROGRESSED, message, {"attempt": attempt, "progress": percent})


def execute_claims(claim: Claim | None) -> None:
    """Run a chain of in-process claims until settle hands back none; then
    arm the run timer the first claim owed, if its run is still EXECUTING."""
    owed = claim.timer_owed if claim is not None else None
    try:
        while claim is not None:
            claim = step_execute(claim.step_pk, claim.attempt, started=claim.started, steps=claim.steps,
                                 spare=claim.spare)
    finally:
        if owed is not None:
            try:
                arm_timer_if_executing(owed)
            except Exception:  # the database or the broker is down: the deadline scan stands in
                logger.exception("run %s: could not arm its timer", owed.pk)

