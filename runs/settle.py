"""Settling an EXECUTING run: the one place that decides what it does next
(docs/stages.md#executing).

``run_settle`` (and ``settle_locked``, for a caller already holding the
run's row lock) dispatches the steps whose dependencies succeeded, or takes
the run's next edge (TRACING, FAILED, TIMEOUT, CANCELLED). It holds the
run's row lock, so two steps finishing together cannot both decide; every
path takes the run's lock before its steps'. A step's moves are
``runs.step_lifecycle``'s.

A ready step is queued for a worker, or, with ``claim_one``, started at
once for the worker that settles (its slot held), saving a broker round
trip on a sequential plan. That next step may have been forecast before the
transaction (``Forecast``): its handle and plan are fixed then, so a spare
shim can set up its sandbox meanwhile (``runs.execution``).
"""

from dataclasses import dataclass, replace

from django.db import DatabaseError
from django.utils import timezone

from runs.closing import run_close
from runs.dataplane import (
    current_host,
    hand_over_reservation,
    new_handle_id,
    queue_for,
    release_reservation,
    reserve_slot,
    resolve_step_plan,
    warm_shim,
    weaker_than_rated,
)
from runs.dispatch import Claim, enqueue_claims, enqueue_settle
from runs.errors import ErrorCode, error_envelope
from runs.models import Event, EventType, Run, Step, StepRunStatus, StepStatus, TraceKind
from runs.outbox import emit, emit_step_event
from runs.statemachine import RunState
from runs.step_lifecycle import IN_FLIGHT, NO_ATTEMPT, step_set
from runs.steps import skip_pending
from runs.transitions import TraceRecord, lock_run, run_transition
from runtime import statements
from runtime.envelopes import EnvelopeError
from runtime.forkserver import ShimLink
from runtime.launcher import discard_preset

S = RunState

# What settle reads of every step of the run, each time: results and
# effective plans are the bulk of a row (a failure loads its result).
# Who the audit row of a run timeout names when the run's own timer ended the
# run (``settle_run`` at the deadline); a step's result settling a run past
# its deadline leaves the edge's own caller (the tool controller).
RUN_TIMER = "run timer"
SETTLE_STEP_FIELDS = ("id", "run_id", "step_id", "tool", "params", "depends_on", "timeout_s", "retries", "status",
                      "run_status", "attempt", "handle_id", "requested_plan", "rated_plan")


@dataclass(frozen=True)
class Forecast:
    """The step a chain most likely starts next on this worker, chosen
    before the transaction that decides it, with the handle and plan it
    then gets (``_dispatch`` uses both when it starts that step here)."""

    step_pk: int
    handle_id: str
    plan: dict


def forecast_next(finished: Step | None, steps: list[Step]) -> tuple[Step, Forecast] | None:
    """What settle will start here once ``finished`` (the only step in
    flight, of ``steps``) is recorded as succeeded, or first when None (the
    run is entering EXECUTING): the first ready step, as in
    ``settle_locked``, if this worker may run it."""
    done = {step.step_id for step in steps if step.status == StepStatus.SUCCESS}
    if finished is not None:
        done.add(finished.step_id)
    following = next((step for step in steps if step.status == StepStatus.PENDING and not step.run_status
                      and all(dep in done for dep in step.depends_on)), None)
    plan = _local_plan(following) if following is not None else None
    if plan is None:
        return None
    return following, Forecast(following.pk, new_handle_id(following, 1), plan)


# A spare shim with the step it was forked for (``warm_first``).
Warmed = tuple[ShimLink | None, Forecast | None]


def warm_first(steps: list[Step], warmed: Warmed | None = None) -> Warmed:
    """A spare for the step a run entering EXECUTING starts first here, its
    sandbox pre-started for that step (``forecast_next``). ``warmed``: a
    spare forked earlier, once the policy let the run execute but before
    its rated plans were bound: kept if the forecast now names the same
    step with the same plan, else closed. A spare whose step does not come, or
    comes otherwise, never runs anything (``shim_prestart``)."""
    first, forecast = forecast_next(None, steps) or (None, None)
    if warmed is not None:
        spare, early = warmed
        if spare is not None and forecast is not None and early is not None \
                and (early.step_pk, early.plan) == (forecast.step_pk, forecast.plan):
            return spare, early
        close_unused(spare, early)  # forecast before the rating was bound: no transaction named it
    if forecast is None:
        return None, None
    return warm_shim(first, following=first, handle_id=forecast.handle_id, plan=forecast.plan), forecast


def close_unused(spare: ShimLink | None, forecast: Forecast | None, *, maybe_recorded: bool = False) -> None:
    """Close a spare no step was started in (it exits, its sandbox having
    run nothing), and remove the task directory its forecast's preset made
    (``launcher.sandbox_preset``) unless a step names that handle: the
    forecast step dispatched to the queue with it (``_dispatch``), whose
    task prepares it there. ``maybe_recorded``: the caller's transaction
    may have done so (read here; a database that cannot answer keeps the
    directory); else no transaction ever had the forecast."""
    if spare is not None:
        spare.close()
    if forecast is None:
        return
    if maybe_recorded:
        try:
            if Step.objects.filter(pk=forecast.step_pk, handle_id=forecast.handle_id).exists():
                return
        except DatabaseError:
            return
    discard_preset(forecast.handle_id)


def executing_started(run: Run) -> None:
    """Arm the harness's own run timer: a settle at the deadline fires
    TIMEOUT even when no step ever finishes (the deadline scan is the
    fallback). A run that entered EXECUTING in a worker's chain of claims
    gets it when that chain ends, only if it is still EXECUTING then
    (``arm_timer_if_executing``): most short runs end inside that chain and
    never need one."""
    remaining = max((run.deadline - timezone.now()).total_seconds(), 0)
    # Expires: a timer parked in a dead worker's unacked set comes back
    # hours later (Redis' visibility timeout) and is then dropped unrun; the
    # deadline scan (runs.deadlines) has long enforced the deadline by then.
    enqueue_settle(run.pk, countdown=remaining + 0.5, expires=remaining + 60)


def arm_timer_if_executing(run: Run) -> None:
    """The timer a chain of claims owed its run (``Claim.timer_owed``),
    armed now that the chain has ended, if the run is still EXECUTING: a
    step handed to the watcher, dispatched elsewhere or back in the queue.
    A worker that dies before this leaves the run to the deadline scan,
    as a dead worker's parked timer would."""
    if Run.objects.filter(pk=run.pk, state=S.EXECUTING).exists():
        executing_started(run)


def run_settle(run_id: int, *, claim_one: bool = False, handover: str = "", caller: str | None = None,
               first: bool = False, steps: list[Step] | None = None, warmed: Warmed | None = None) -> Claim | None:
    """Decide the run's next move. With ``claim_one``, one ready step that
    may run here is started at once for the caller to execute in-process
    (saving a broker round trip and a transaction on a sequential plan),
    taking over the reservation of the ``handover`` handle when it can; the
    other ready steps are enqueued after commit. ``caller``: who the audit
    row names if this settle times the run out (the run's timer, the
    deadline scan); the edge's own caller otherwise. ``first`` (the run has
    just entered EXECUTING): the step to be started here is forecast, and
    its shim forked with its sandbox pre-started while this transaction
    dispatches it and commits (``warm_first``; the claim carries the
    spare). ``steps``: with ``first``, the run's steps as its stages just
    created and rated them in the caller's transaction, else read here.
    ``warmed``: with ``first``, the spare the policy stage forked
    (``warm_first``), now this call's to use or close."""
    spare, forecast = warmed or (None, None)
    try:
        with statements.in_transaction():  # no savepoint in the stages' transaction
            run = lock_run(run_id)
            if first and claim_one and run is not None and run.state == S.EXECUTING:
                if steps is None:
                    steps = list(Step.objects.filter(run_id=run_id).only(*SETTLE_STEP_FIELDS))
                spare, forecast = warm_first(steps, (spare, forecast))
            else:
                close_unused(spare, forecast)  # nothing is dispatched with it
                spare = forecast = steps = None
            claim, close = settle_locked(run, [], claim_one=claim_one, handover=handover, caller=caller,
                                         steps=steps, forecast=forecast)
        if forecast is not None and claim is not None and claim.started is not None \
                and claim.started.handle_id == forecast.handle_id:
            if spare is not None:
                claim = replace(claim, spare=spare)
            spare = forecast = None
    finally:
        close_unused(spare, forecast, maybe_recorded=True)  # not started here: its sandbox never ran anything
    if close:
        run_close(run_id, tracing=run)
    return claim


def settle_locked(run: Run | None, events: list[Event], *, claim_one: bool, handover: str,
                  steps: list[Step] | None = None, forecast: Forecast | None = None,
                  caller: str | None = None) -> tuple[Claim | None, bool]:
    """``run_settle`` under the run's row lock (``run``: read under it in
    this transaction, ``lock_run``); ``events`` are the caller's
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
    return None, _end_execution(run, steps, in_flight, failed, now, caller=caller)


def _end_execution(run: Run, steps: list[Step], in_flight: list[Step], failed: list[Step], now, *,
                   caller: str | None) -> bool:
    """Take the run's edge out of EXECUTING once nothing more is dispatched:
    CANCELLED, TIMEOUT, FAILED or TRACING, moving ``run``, the copy read
    under its row lock, as it is. False while an attempt still runs (its end
    settles again)."""
    if run.cancel_requested_at is not None or now >= run.deadline:
        cancelled = run.cancel_requested_at is not None
        skip_pending(run, steps, "run cancelled" if cancelled else "run timed out")
        _cancel_queued(run, in_flight)
        if any(step.run_status == StepRunStatus.RUNNING for step in in_flight):
            return False
        if cancelled:
            run_transition(run, S.CANCELLED, actor=run.cancel_requested_by, expected=S.EXECUTING, held=True,
                           trace=TraceRecord(TraceKind.RUN, {"cancelled_by": run.cancel_requested_by_id}))
            return True
        error = error_envelope(ErrorCode.TIMEOUT, f"run exceeded its timeout of {run.timeout_s}s",
                               source="scheduler", details={"timeout_s": run.timeout_s, "layer": "harness"})
        run_transition(run, S.TIMEOUT, caller=caller, expected=S.EXECUTING, held=True,
                       message=error["message"], data={"layer": "harness"},
                       trace=TraceRecord(TraceKind.RUN, {"timeout_s": run.timeout_s, "layer": "harness"},
                                         error=error))
    elif failed:
        skip_pending(run, steps, f"step {failed[0].step_id} failed")
        if in_flight:
            return False
        first = failed[0]
        error = (first.result or {}).get("error") or error_envelope(
            ErrorCode.UNKNOWN, f"step {first.step_id} failed", source="executor")
        run_transition(run, S.FAILED, expected=S.EXECUTING, held=True,
                       message=error["message"],
                       trace=TraceRecord(TraceKind.TOOL_INVOCATION,
                                         {"tool": first.tool, "step": first.step_id,
                                          "retry_count": max(first.attempt - 1, 0)},
                                         error=error, step=first))
    else:  # every step succeeded
        run_transition(run, S.TRACING, expected=S.EXECUTING, held=True)
    return True


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
        handle_id = ahead.handle_id if ahead is not None else new_handle_id(step, 1)
        step.handle_id = handle_id
        accepted = Event(type=EventType.TASK_ACCEPTED, run=run, task_id=step.step_id, handle_id=handle_id,
                         timestamp=now, message="accepted", data={"attempt": 1})
        if step is local:
            # Started here only with its slot held (the finished step's, handed
            # over, or a free one): a step never waits for a slot once started.
            step.effective_plan = local_plan
            handed_over = bool(handover) and hand_over_reservation(handover, step)
            if not (handed_over or reserve_slot(step)):
                local = None
        if step is local:
            if step_set(step, expect=(StepStatus.PENDING, NO_ATTEMPT), to=(StepStatus.RUNNING, StepRunStatus.RUNNING),
                        attempt=1, handle_id=handle_id, host=current_host(), started_at=now,
                        effective_plan=local_plan):
                step.run = run
                events.extend([accepted, Event(type=EventType.TASK_STARTED, run=run, task_id=step.step_id,
                                               handle_id=handle_id, timestamp=now, message="started",
                                               data={"attempt": 1, "host": step.host, "plan": local_plan})])
                claim = Claim(step.pk, 1, queue_for(step), started=step, reserved=handed_over)
            else:
                release_reservation(handle_id, only_mine=True)
        elif step_set(step, expect=(StepStatus.PENDING, NO_ATTEMPT), to=(StepStatus.PENDING, StepRunStatus.ACCEPTED),
                      attempt=1, handle_id=handle_id):
            events.append(accepted)
            claims.append(Claim(step.pk, 1, queue_for(step)))
    emit(events)
    return claim, claims


def _cancel_queued(run: Run, in_flight: list[Step]) -> None:
    """Accepted attempts that have not started (queued, or waiting out a
    retry backoff) are cancelled here; their task finds the claim gone."""
    for step in in_flight:
        if step.run_status == StepRunStatus.ACCEPTED and step_set(
            step, expect=(step.status, StepRunStatus.ACCEPTED), to=(StepStatus.FAILED, StepRunStatus.CANCELLED),
            where={"attempt": step.attempt}, finished_at=timezone.now(),
        ):
            emit_step_event(run.pk, step, EventType.TASK_CANCELLED, "cancelled before it started",
                            {"attempt": step.attempt})
