"""EXECUTING: the plan as a DAG of steps on the workers (docs/stages.md#executing).

Lifecycle of a step (two layers)::

    status      pending ──► running ──► success | failed        (or pending ──► skipped)
    run_status  "" ──► accepted ──► running ──► success | failed | cancelled
                          ▲                          │
                          └──── retry (attempt+1) ◄──┘  retryable error, attempts left

Settling (``run_settle``, ``_settle_locked``) is the one place that decides
what a running run does next: dispatch the steps whose dependencies
succeeded, or take the run's next edge (TRACING, FAILED, TIMEOUT,
CANCELLED). It holds the run's row lock, so two steps finishing together
cannot both decide; every path takes the run's lock before its steps'.
``step_execute`` runs one claimed attempt; ``step_finish`` writes its result
fenced by the attempt number (a late result of a superseded attempt is
audited and dropped) and settles in the same transaction.

Between two steps of a sequential plan a worker commits one transaction:
the result, the next step started, the slot handed over and their events;
meanwhile the fork server forks the next step's shim (a spare, started once
that transaction has committed, closed unused if no step follows here).
That next step is forecast before the transaction (``Forecast``): its
handle and plan are fixed then, so the spare can also set up its sandbox
meanwhile (``runtime.shim.Prestart``); the shim runs the command there only
if the step's request turns out to be exactly the one forecast.
"""

import logging
import random
import time
from dataclasses import dataclass, replace
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
    hand_over_reservation,
    host_capabilities,
    new_handle_id,
    plan_needs,
    queue_for,
    reattach,
    release_reservation,
    reserve_slot,
    resolve_step_plan,
    run_tool,
    wait_for_slot,
    warm_shim,
    weaker_than_rated,
)
from runs.dispatch import Claim, enqueue_claims, enqueue_settle
from runs.errors import ErrorCode, error_envelope
from runs.healing import ledger_heal
from runs.metrics import count_step_end
from runs.models import AuditEvent, Event, EventType, Run, Step, StepRunStatus, StepStatus, TraceKind
from runs.outbox import emit, emit_step_event, step_event
from runs.statemachine import RunState
from runs.steps import IN_FLIGHT, skip_pending, unstarted_result
from runs.transitions import TraceRecord, lock_run, run_transition
from runtime import statements
from runtime.envelopes import EnvelopeError
from runtime.forkserver import ShimLink
from runtime.models import HostCapacity

S = RunState
logger = logging.getLogger(__name__)

CANCEL_POLL_S = 0.1
MAX_BACKOFF_S = 30.0
# Who the audit row of a run timeout names when the run's own timer ended the
# run (``settle_run`` at the deadline); a step's result settling a run past
# its deadline leaves the edge's own caller (the tool controller).
RUN_TIMER = "run timer"


@dataclass(frozen=True)
class Forecast:
    """The step a chain most likely starts next on this worker, chosen
    before the transaction that decides it, with the handle and plan it
    then gets (``_dispatch`` uses both when it starts that step here)."""

    step_pk: int
    handle_id: str
    plan: dict


def _forecast(finished: Step, steps: list[Step]) -> tuple[Step, Forecast] | None:
    """What settle will start here once ``finished`` (the only step in
    flight, of ``steps``) is recorded as succeeded: the first ready step, as
    in ``_settle_locked``, if this worker may run it."""
    done = {step.step_id for step in steps if step.status == StepStatus.SUCCESS} | {finished.step_id}
    following = next((step for step in steps if step.status == StepStatus.PENDING and not step.run_status
                      and all(dep in done for dep in step.depends_on)), None)
    plan = _local_plan(following) if following is not None else None
    if plan is None:
        return None
    return following, Forecast(following.pk, new_handle_id(following, 1), plan)


def executing_started(run: Run) -> None:
    """Arm the harness's own run timer: a settle at the deadline fires
    TIMEOUT even when no step ever finishes (the sweeper is the fallback)."""
    remaining = max((run.deadline - timezone.now()).total_seconds(), 0)
    # Expires: a timer parked in a dead worker's unacked set comes back
    # hours later (Redis' visibility timeout) and is then dropped unrun; the
    # deadline scan (runs.deadlines) has long enforced the deadline by then.
    enqueue_settle(run.pk, countdown=remaining + 0.5, expires=remaining + 60)


# What settle reads of every step of the run, each time: results and
# effective plans are the bulk of a row (a failure loads its result).
SETTLE_STEP_FIELDS = ("id", "run_id", "step_id", "tool", "params", "depends_on", "timeout_s", "retries", "status",
                      "run_status", "attempt", "handle_id", "requested_plan", "rated_plan")


def run_settle(run_id: int, *, claim_one: bool = False, handover: str = "", caller: str | None = None) -> Claim | None:
    """Decide the run's next move. With ``claim_one``, one ready step that
    may run here is started at once for the caller to execute in-process
    (saving a broker round trip and a transaction on a sequential plan),
    taking over the reservation of the ``handover`` handle when it can; the
    other ready steps are enqueued after commit. ``caller``: who the audit
    row names if this settle times the run out (the run's timer, the
    deadline scan); the edge's own caller otherwise."""
    with transaction.atomic():
        run = lock_run(run_id)
        claim, close = _settle_locked(run, [], claim_one=claim_one, handover=handover, caller=caller)
    if close:
        run_close(run_id)
    return claim


def _settle_locked(run: Run | None, events: list[Event], *, claim_one: bool, handover: str,
                   steps: list[Step] | None = None, forecast: Forecast | None = None,
                   caller: str | None = None) -> tuple[Claim | None, bool]:
    """``run_settle`` under the run's row lock; ``events`` are the caller's
    not yet written, committed with the decision and ahead of its own.
    ``steps``: the run's steps when the caller knows them (see
    ``Claim.steps``); ``forecast``: the caller's (see ``Forecast``). Returns
    the in-process claim and whether the run must now be closed."""
    if run is None or run.state != S.EXECUTING:
        emit(events)
        return None, False
    now = timezone.now()
    going_on = run.cancel_requested_at is None and now < run.deadline
    if steps is None or not going_on:
        steps = list(Step.objects.filter(run_id=run.pk).only(*SETTLE_STEP_FIELDS))
    by_id = {step.step_id: step for step in steps}
    in_flight = [step for step in steps if step.run_status in IN_FLIGHT]
    failed = [step for step in steps if step.status == StepStatus.FAILED]

    if going_on and not failed and any(step.status != StepStatus.SUCCESS for step in steps):
        ready = [step for step in steps if step.status == StepStatus.PENDING and not step.run_status
                 and all(by_id[dep].status == StepStatus.SUCCESS for dep in step.depends_on)]
        claim, claims = _dispatch(run, ready, events, claim_one=claim_one, handover=handover, forecast=forecast)
        if claim is not None and len(ready) == 1 and not in_flight:
            claim = replace(claim, steps=steps)  # the claimed attempt is the only one in flight
        enqueue_claims(claims)
        return claim, False

    emit(events)  # ahead of the events of the edge taken below
    if run.cancel_requested_at is not None:
        skip_pending(run, steps, "run cancelled")
        _cancel_queued(run, in_flight)
        if any(step.run_status == StepRunStatus.RUNNING for step in in_flight):
            return None, False
        run_transition(run, S.CANCELLED, actor=run.cancel_requested_by, expected=S.EXECUTING,
                       trace=TraceRecord(TraceKind.RUN, {"cancelled_by": run.cancel_requested_by_id}))
    elif now >= run.deadline:
        skip_pending(run, steps, "run timed out")
        _cancel_queued(run, in_flight)
        if any(step.run_status == StepRunStatus.RUNNING for step in in_flight):
            return None, False
        error = error_envelope(ErrorCode.TIMEOUT, f"run exceeded its timeout of {run.timeout_s}s",
                               source="scheduler", details={"timeout_s": run.timeout_s, "layer": "harness"})
        run_transition(run, S.TIMEOUT, caller=caller, expected=S.EXECUTING,
                       message=error["message"], data={"layer": "harness"},
                       trace=TraceRecord(TraceKind.RUN, {"timeout_s": run.timeout_s, "layer": "harness"},
                                         error=error))
    elif failed:
        skip_pending(run, steps, f"step {failed[0].step_id} failed")
        if in_flight:
            return None, False
        first = failed[0]
        error = (first.result or {}).get("error") or error_envelope(
            ErrorCode.UNKNOWN, f"step {first.step_id} failed", source="executor")
        run_transition(run, S.FAILED, expected=S.EXECUTING,
                       message=error["message"],
                       trace=TraceRecord(TraceKind.TOOL_INVOCATION,
                                         {"tool": first.tool, "step": first.step_id,
                                          "retry_count": max(first.attempt - 1, 0)},
                                         error=error, step=first))
    else:  # every step succeeded
        run_transition(run, S.TRACING, expected=S.EXECUTING)
    return None, True


def _local_plan(step: Step) -> dict | None:
    """The effective plan if this worker may start ``step`` itself."""
    if not Claim(step.pk, 1, queue_for(step)).runnable_here():
        return None
    try:
        plan = resolve_step_plan(step)
    except EnvelopeError:
        return None  # refused here: the task path records the refusal
    return None if weaker_than_rated(plan, step.rated_plan) else plan


def _dispatch(run: Run, ready: list[Step], events: list[Event], *, claim_one: bool, handover: str,
              forecast: Forecast | None = None) -> tuple[Claim | None, list[Claim]]:
    def forecast_for(step: Step) -> Forecast | None:
        return forecast if forecast is not None and forecast.step_pk == step.pk else None

    def plan_for(step: Step) -> dict | None:
        ahead = forecast_for(step)
        return ahead.plan if ahead is not None else _local_plan(step)

    local, local_plan = None, None
    if claim_one:
        local, local_plan = next(((step, plan) for step in ready if (plan := plan_for(step)) is not None),
                                 (None, None))
    claim, claims = None, []
    now = timezone.now()
    for step in ready:
        ahead = forecast_for(step)
        step.handle_id = ahead.handle_id if ahead is not None else new_handle_id(step, 1)
        pending = {"id": step.pk, "status": StepStatus.PENDING, "run_status": ""}
        accepted = Event(type=EventType.TASK_ACCEPTED, run=run, task_id=step.step_id, handle_id=step.handle_id,
                         timestamp=now, message="accepted", data={"attempt": 1})
        if step is local:
            # Started here only with its slot held (the finished step's, handed
            # over, or a free one): a step never waits for a slot once started.
            step.effective_plan = local_plan
            handed_over = bool(handover) and hand_over_reservation(handover, step)
            if not (handed_over or reserve_slot(step)):
                local = None
        if step is local:
            started = {"status": StepStatus.RUNNING, "run_status": StepRunStatus.RUNNING, "attempt": 1,
                       "handle_id": step.handle_id, "host": current_host(), "started_at": now,
                       "effective_plan": local_plan}
            if statements.update(Step, pending, started):
                for name, value in started.items():
                    setattr(step, name, value)
                step.run = run
                events.extend([accepted, Event(type=EventType.TASK_STARTED, run=run, task_id=step.step_id,
                                               handle_id=step.handle_id, timestamp=now, message="started",
                                               data={"attempt": 1, "host": step.host, "plan": local_plan})])
                claim = Claim(step.pk, 1, queue_for(step), started=step, reserved=handed_over)
            else:
                release_reservation(step.handle_id, only_mine=True)
        elif statements.update(Step, pending, {"run_status": StepRunStatus.ACCEPTED, "attempt": 1,
                                               "handle_id": step.handle_id}):
            events.append(accepted)
            claims.append(Claim(step.pk, 1, queue_for(step)))
    emit(events)
    return claim, claims


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


def _cancel_queued(run: Run, in_flight: list[Step]) -> None:
    """Accepted attempts that have not started (queued, or waiting out a
    retry backoff) are cancelled here; their task finds the claim gone."""
    for step in in_flight:
        if step.run_status == StepRunStatus.ACCEPTED and Step.objects.filter(
            pk=step.pk, attempt=step.attempt, run_status=StepRunStatus.ACCEPTED
        ).update(run_status=StepRunStatus.CANCELLED, status=StepStatus.FAILED, finished_at=timezone.now()):
            step.run_status = StepRunStatus.CANCELLED
            emit_step_event(run.pk, step, EventType.TASK_CANCELLED, "cancelled before it started",
                            {"attempt": step.attempt})


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
        step = Step.objects.select_related("run").filter(pk=step_pk, attempt=attempt,
                                                         run_status=StepRunStatus.ACCEPTED).first()
        if step is None:
            return None  # gone, a duplicate delivery, or the attempt was cancelled or superseded
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
        # Not held otherwise: the attempt is claimed to be ended unstarted below.
        try:
            with transaction.atomic():
                claim = {"status": StepStatus.RUNNING, "run_status": StepRunStatus.RUNNING,
                         "started_at": timezone.now(), "host": current_host(), "effective_plan": step.effective_plan}
                claimed = Step.objects.filter(pk=step_pk, attempt=attempt,
                                              run_status=StepRunStatus.ACCEPTED).update(**claim)
                if claimed:
                    for name, value in claim.items():
                        setattr(step, name, value)
                    emit_step_event(step.run_id, step, EventType.TASK_STARTED, "started",
                                    {"attempt": attempt, "host": step.host, "plan": step.effective_plan})
        except BaseException:
            release_reservation(step.handle_id, only_mine=True)
            raise
        if not claimed:
            # Lost the claim to a duplicate delivery or a cancel: give back
            # only a slot this process took (never the winner's).
            release_reservation(step.handle_id, only_mine=True)
            return None
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
                on_progress=lambda percent, message: _progress(run.pk, step, attempt, percent, message),
                spare=spare,
                # While it runs, the step that most likely follows here is made ready to start.
                while_running=(lambda: ahead.append(_warm_following(step, steps))) if steps is not None else None,
            )
    except BaseException:
        release_reservation(step.handle_id)
        for following_spare, _forecast_made in ahead:
            if following_spare is not None:
                following_spare.close()
        raise
    return step_finish(step, attempt, result, steps=steps, ahead=ahead[0] if ahead else None)


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
                      on_progress=lambda percent, message: _progress(step.run_id, step, attempt, percent, message))
    audit(AuditEvent.STEP_REATTACHED, run_id=step.run_id, tenant_id=step.run.tenant_id, caller="recovery",
          data={"step": step.step_id, "attempt": attempt, "handle_id": step.handle_id, "status": result["status"]})
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
        if spare is not None:
            spare.close()
        spare = forecast = None
    elif ahead is None:  # the step ran in this process (not in a shim): made ready now, during the transaction
        spare, forecast = _warm_following(step, steps)
    try:
        claim = _step_finish(step, attempt, result, steps=steps, forecast=forecast)
        if spare is not None and claim is not None and claim.started is not None:
            claim, spare = replace(claim, spare=spare), None
        return claim
    finally:
        if spare is not None:
            spare.close()  # no step of this chain follows here: the spare exits


def _warm_following(step: Step, steps: list[Step]) -> tuple[ShimLink | None, Forecast | None]:
    """For a chain that most likely goes on here once ``step`` succeeded:
    a spare shim for the step that follows, forecast (see ``Forecast``) so
    that its sandbox is set up in the spare too; nothing when no step is
    pending."""
    if not any(other.status == StepStatus.PENDING and not other.run_status for other in steps):
        return None, None
    following, forecast = _forecast(step, steps) or (None, None)
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
    with transaction.atomic():
        locked = lock_run(run.pk)
        fenced = statements.update(
            Step, {"id": step.pk, "attempt": attempt, "run_status": StepRunStatus.RUNNING},
            {"run_status": result["status"], "result": result, "finished_at": timezone.now(),
             "status": StepStatus.RUNNING if retry else status,
             "progress": 100 if status == StepStatus.SUCCESS else None},
        )
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
            Step.objects.filter(pk=step.pk, attempt=attempt).update(
                attempt=next_attempt, run_status=StepRunStatus.ACCEPTED, handle_id=step.handle_id
            )
            events.append(step_event(run.pk, step, EventType.TASK_RETRIED,
                                      f"retrying in {backoff:.1f}s after attempt {attempt}",
                                      {"attempt": next_attempt, "backoff_s": backoff, "error": result["error"]}))
            emit(events)
            transaction.on_commit(lambda: release_reservation(finished_handle))
            enqueue_claims([Claim(step.pk, next_attempt, queue_for(step))], countdown=backoff)
            return None
        known = None
        if steps is not None and status == StepStatus.SUCCESS:
            # ``step`` is one of ``steps`` (the claim's started step): as just written.
            step.status, step.run_status = StepStatus.SUCCESS, StepRunStatus.SUCCESS
            known = steps
        claim, close = _settle_locked(locked, events, claim_one=True, handover=finished_handle, steps=known,
                                      forecast=forecast)
    if close:
        run_close(run.pk)
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


def _progress(run_id: int, step: Step, attempt: int, percent: int, message: str) -> None:
    with transaction.atomic():
        if Step.objects.filter(pk=step.pk, attempt=attempt, run_status=StepRunStatus.RUNNING).update(
            progress=percent
        ):
            emit_step_event(run_id, step, EventType.TASK_PROGRESSED, message, {"attempt": attempt, "progress": percent})


def execute_claims(claim: Claim | None) -> None:
    """Run a chain of in-process claims until settle hands back none."""
    while claim is not None:
        claim = step_execute(claim.step_pk, claim.attempt, started=claim.started, steps=claim.steps,
                             spare=claim.spare)

