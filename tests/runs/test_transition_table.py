"""Every (from, to) pair of the 15 run states against
docs/state-machine.md#legal-transitions.

The expected tables below are a hand-written copy of the tables of
docs/state-machine.md (legal transitions, sweeper-only transitions, closing
cause, Job status projection), written out on purpose rather than read from
the module: the tests fail if ``runs.statemachine`` drifts from the
documented tables, not only if the transition service disagrees with the
module it reads.
"""

import itertools
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone
from django_fsm import ConcurrentTransition

from runs.models import AuditLog, Event, Job, Run, Trace
from runs.statemachine import (
    ENTERED_ONCE,
    FINAL_STATE_FOR_CAUSE,
    TRANSITIONS,
    ZOMBIE_SWEEPER,
    RunState,
    closing_cause_for,
    is_legal,
    job_status_for,
)
from runs.transitions import InvalidTransitionError, TransitionLost, run_transition
from tests.conftest import postgres_only

# The audit path may use a second connection: every test that transitions a
# run needs committed rows, hence transactional tests.
transactional = pytest.mark.django_db(transaction=True)

STATES = [state.value for state in RunState]


# docs/state-machine.md#legal-transitions (without the sweeper-only rows).
EXPECTED_EDGES = frozenset({
    ("CREATED", "PREPARING"),
    ("PREPARING", "PLANNING"),
    ("PREPARING", "FAILED"),
    ("PLANNING", "POLICY_CHECK"),
    ("PLANNING", "FAILED"),
    ("PLANNING", "TIMEOUT"),
    ("POLICY_CHECK", "EXECUTING"),
    ("POLICY_CHECK", "AWAITING_HITL"),
    ("POLICY_CHECK", "REJECTED"),
    ("AWAITING_HITL", "EXECUTING"),
    ("AWAITING_HITL", "REJECTED"),
    ("AWAITING_HITL", "TIMEOUT"),
    ("AWAITING_HITL", "CANCELLED"),
    ("EXECUTING", "TRACING"),
    ("EXECUTING", "FAILED"),
    ("EXECUTING", "TIMEOUT"),
    ("EXECUTING", "CANCELLED"),
    ("REJECTED", "TRACING"),
    ("FAILED", "TRACING"),
    ("TIMEOUT", "TRACING"),
    ("CANCELLED", "TRACING"),
    ("TRACING", "SUCCEEDED"),
    ("TRACING", "CLOSED_REJECTED"),
    ("TRACING", "CLOSED_FAILED"),
    ("TRACING", "CLOSED_CANCELLED"),
})

# docs/state-machine.md#sweeper-only-transitions: legal only with forced_by="zombie_sweeper".
EXPECTED_SWEEPER_ONLY = frozenset({("CREATED", "FAILED"), ("POLICY_CHECK", "FAILED"), ("TRACING", "FAILED")})

# docs/state-machine.md#job-status-projection.
EXPECTED_JOB_STATUS = {
    "CREATED": "pending", "PREPARING": "pending", "PLANNING": "pending", "POLICY_CHECK": "pending",
    "AWAITING_HITL": "running", "EXECUTING": "running", "TRACING": "running",
    "REJECTED": "running", "FAILED": "running", "TIMEOUT": "running", "CANCELLED": "running",
    "SUCCEEDED": "done",
    "CLOSED_REJECTED": "failed", "CLOSED_FAILED": "failed", "CLOSED_CANCELLED": "failed",
}

# docs/state-machine.md#closing-cause, in the closing-cause vocabulary of the code.
EXPECTED_FINAL_FOR_CAUSE = {
    "succeeded": "SUCCEEDED",
    "rejected": "CLOSED_REJECTED",
    "approval_timeout": "CLOSED_REJECTED",
    "failed": "CLOSED_FAILED",
    "planning_timeout": "CLOSED_FAILED",
    "run_timeout": "CLOSED_FAILED",
    "cancelled": "CLOSED_CANCELLED",
}

FINAL_AUDIT_EVENT = {
    "SUCCEEDED": "run_succeeded",
    "CLOSED_REJECTED": "run_rejected",
    "CLOSED_FAILED": "run_failed",
    "CLOSED_CANCELLED": "run_cancelled",
}

# Where each transient state plausibly came from (a TIMEOUT's origin decides
# its closing cause; the others do not depend on it).
ORIGIN_OF = {"REJECTED": "POLICY_CHECK", "FAILED": "EXECUTING", "TIMEOUT": "EXECUTING", "CANCELLED": "EXECUTING"}
CAUSE_ENTERING_TRACING_FROM = {
    "EXECUTING": "succeeded", "REJECTED": "rejected", "FAILED": "failed", "TIMEOUT": "run_timeout",
    "CANCELLED": "cancelled",
}


def cause_closing_into(final_state: str) -> str:
    return next(cause for cause, final in FINAL_STATE_FOR_CAUSE.items() if final == final_state)


def place_run(make_run, source: str, target: str, **fields) -> Run:
    """A run sitting in ``source``, set up so that the edge to ``target``
    depends only on the table."""
    closing_cause = ""
    if source == "TRACING":
        closing_cause = cause_closing_into(target) if target in FINAL_AUDIT_EVENT else "succeeded"
    fields.setdefault("last_state_change_at", timezone.now() - timedelta(hours=1))
    return make_run(source, previous_state=ORIGIN_OF.get(source, ""), closing_cause=closing_cause, **fields)


def counts(run: Run) -> tuple[int, int, int]:
    return (
        Trace.objects.filter(run=run).count(),
        Event.objects.filter(run=run).count(),
        AuditLog.objects.filter(run_id=run.pk).count(),
    )


def test_module_table_is_the_spec_table():
    declared = {(edge.source.value, edge.target.value): edge.sweeper_only for edge in TRANSITIONS}
    assert len(declared) == len(TRANSITIONS), "an edge is declared twice"
    assert {pair for pair, sweeper in declared.items() if not sweeper} == EXPECTED_EDGES
    assert {pair for pair, sweeper in declared.items() if sweeper} == EXPECTED_SWEEPER_ONLY
    assert {cause: state.value for cause, state in FINAL_STATE_FOR_CAUSE.items()} == EXPECTED_FINAL_FOR_CAUSE
    assert {state: job_status_for(state) for state in STATES} == EXPECTED_JOB_STATUS


def test_is_legal_agrees_with_the_spec_for_every_pair():
    for source, target in itertools.product(STATES, STATES):
        cause = cause_closing_into(target) if source == "TRACING" and target in FINAL_AUDIT_EVENT else None
        expected = (source, target) in EXPECTED_EDGES
        assert is_legal(source, target, closing_cause=cause) is expected, (source, target)
        forced = (source, target) in EXPECTED_EDGES | EXPECTED_SWEEPER_ONLY
        assert is_legal(source, target, closing_cause=cause, forced_by=ZOMBIE_SWEEPER) is forced, (source, target)


def check_pair(make_run, source: str, target: str) -> None:
    run = place_run(make_run, source, target)
    legal = (source, target) in EXPECTED_EDGES
    assert is_legal(source, target, closing_cause=run.closing_cause) is legal, "module table drifted from the docs"
    # A projection that is already right proves nothing: start from a wrong one.
    Job.objects.filter(pk=run.job_id).update(status="done" if EXPECTED_JOB_STATUS[target] != "done" else "failed")
    job_before = Job.objects.get(pk=run.job_id)
    before = counts(run)

    if not legal:
        with pytest.raises(InvalidTransitionError) as excinfo:
            run_transition(run, target, caller="test")
        assert (excinfo.value.source, excinfo.value.target, excinfo.value.caller) == (source, target, "test")
        fresh = Run.objects.get(pk=run.pk)
        assert fresh.state == source
        assert fresh.last_state_change_at == run.last_state_change_at
        traces, events, audits = counts(run)
        assert (traces, events) == before[:2], "an illegal attempt wrote a trace or event"
        assert audits == before[2] + 1
        row = AuditLog.objects.filter(run_id=run.pk).latest("id")
        assert (row.event, row.from_state, row.to_state, row.caller) == ("invalid_transition", source, target, "test")
        assert row.tenant_id == run.tenant_id
        assert Job.objects.get(pk=run.job_id).status == job_before.status
        return

    returned = run_transition(run, target, caller="test")
    fresh = Run.objects.get(pk=run.pk)
    assert returned.state == fresh.state == target
    assert fresh.previous_state == source
    assert fresh.last_state_change_at > run.last_state_change_at
    assert counts(run) == (before[0] + 1, before[1] + 1, before[2] + 1)

    trace = Trace.objects.get(run=run)
    assert (trace.kind, trace.from_state, trace.to_state) == ("transition", source, target)
    assert trace.data["caller"] == "test"
    event = Event.objects.get(run=run)
    assert event.type == "run_state_changed"
    assert (event.data["from"], event.data["to"]) == (source, target)
    audit = AuditLog.objects.get(run_id=run.pk)
    assert audit.event == FINAL_AUDIT_EVENT.get(target, "state_changed")
    assert (audit.from_state, audit.to_state, audit.caller, audit.forced_by) == (source, target, "test", "")

    job = Job.objects.get(pk=run.job_id)
    assert job.status == EXPECTED_JOB_STATUS[target]
    assert job.run_state_snapshot["state"] == target
    assert job.run_state_snapshot["run_id"] == run.pk

    if target == "TRACING":
        assert fresh.closing_cause == CAUSE_ENTERING_TRACING_FROM[source]
        assert event.data["closing_cause"] == fresh.closing_cause
    if target == "EXECUTING":
        assert fresh.executing_started_at is not None
    if target in FINAL_AUDIT_EVENT:
        assert fresh.finished_at is not None
    else:
        assert fresh.finished_at is None


# One test per source state rather than per pair: each transactional test
# truncates every table afterwards, and 225 of those would dominate the suite.
@transactional
@pytest.mark.parametrize("source", STATES)
def test_every_target_from(make_run, source):
    failures = []
    for target in STATES:
        try:
            check_pair(make_run, source, target)
        except AssertionError as exc:
            failures.append(f"{source} → {target}: {exc}")
    assert not failures, "\n".join(failures)


@transactional
@pytest.mark.parametrize("source, target", sorted(EXPECTED_SWEEPER_ONLY))
def test_sweeper_only_edges_need_the_sweeper(make_run, source, target):
    for forced_by in ("", "operator"):
        run = place_run(make_run, source, target)
        with pytest.raises(InvalidTransitionError):
            run_transition(run, target, caller="test", forced_by=forced_by)
        assert Run.objects.get(pk=run.pk).state == source
        row = AuditLog.objects.get(run_id=run.pk)
        assert (row.event, row.from_state, row.to_state, row.forced_by) == (
            "invalid_transition", source, target, forced_by,
        )

    run = place_run(make_run, source, target)
    run_transition(run, target, caller="zombie sweeper", forced_by=ZOMBIE_SWEEPER)
    fresh = Run.objects.get(pk=run.pk)
    assert (fresh.state, fresh.previous_state) == (target, source)
    audit = AuditLog.objects.get(run_id=run.pk)
    assert (audit.event, audit.from_state, audit.to_state, audit.forced_by) == (
        "state_changed", source, target, ZOMBIE_SWEEPER,
    )
    trace = Trace.objects.get(run=run)
    assert trace.data == {"caller": "zombie sweeper", "forced_by": ZOMBIE_SWEEPER}
    assert Job.objects.get(pk=run.job_id).status == "running"


@transactional
def test_the_sweeper_cannot_force_any_other_edge(make_run):
    """forced_by opens exactly the three sweeper-only edges, nothing else."""
    for source in STATES:
        for target in STATES:
            if (source, target) in EXPECTED_EDGES | EXPECTED_SWEEPER_ONLY:
                continue
            run = place_run(make_run, source, target)
            with pytest.raises(InvalidTransitionError):
                run_transition(run, target, caller="zombie sweeper", forced_by=ZOMBIE_SWEEPER)
            assert Run.objects.get(pk=run.pk).state == source, (source, target)
            assert AuditLog.objects.filter(run_id=run.pk, event="invalid_transition").count() == 1


@transactional
@pytest.mark.parametrize("target", sorted(FINAL_AUDIT_EVENT))
def test_tracing_cannot_close_into_another_cause_s_final_state(make_run, target):
    wrong_causes = [cause for cause in [*EXPECTED_FINAL_FOR_CAUSE, ""]
                    if EXPECTED_FINAL_FOR_CAUSE.get(cause) != target]
    assert wrong_causes
    for cause in wrong_causes:
        run = make_run("TRACING", previous_state="EXECUTING", closing_cause=cause)
        with pytest.raises(InvalidTransitionError):
            run_transition(run, target, caller="tracer")
        fresh = Run.objects.get(pk=run.pk)
        assert (fresh.state, fresh.closing_cause, fresh.finished_at) == ("TRACING", cause, None)
        row = AuditLog.objects.get(run_id=run.pk)
        assert (row.event, row.from_state, row.to_state, row.caller) == (
            "invalid_transition", "TRACING", target, "tracer",
        )
        assert not Trace.objects.filter(run=run).exists()


# (origin, transient) → closing cause → final state, driven along real edges
# so that ``previous_state`` is recorded by the service, not by the factory.
CLOSING_PATHS = [
    ("EXECUTING", None, "succeeded", "SUCCEEDED"),
    ("POLICY_CHECK", "REJECTED", "rejected", "CLOSED_REJECTED"),
    ("AWAITING_HITL", "REJECTED", "rejected", "CLOSED_REJECTED"),
    ("PREPARING", "FAILED", "failed", "CLOSED_FAILED"),
    ("PLANNING", "FAILED", "failed", "CLOSED_FAILED"),
    ("EXECUTING", "FAILED", "failed", "CLOSED_FAILED"),
    ("AWAITING_HITL", "TIMEOUT", "approval_timeout", "CLOSED_REJECTED"),
    ("PLANNING", "TIMEOUT", "planning_timeout", "CLOSED_FAILED"),
    ("EXECUTING", "TIMEOUT", "run_timeout", "CLOSED_FAILED"),
    ("AWAITING_HITL", "CANCELLED", "cancelled", "CLOSED_CANCELLED"),
    ("EXECUTING", "CANCELLED", "cancelled", "CLOSED_CANCELLED"),
]


@transactional
@pytest.mark.parametrize("origin, transient, cause, final", CLOSING_PATHS)
def test_closing_cause_is_computed_on_entering_tracing(make_run, origin, transient, cause, final):
    run = make_run(origin)
    if transient:
        run_transition(run, transient, caller="test")
        assert Run.objects.get(pk=run.pk).previous_state == origin
    run_transition(run, "TRACING", caller="state machine")
    fresh = Run.objects.get(pk=run.pk)
    assert fresh.closing_cause == cause
    assert fresh.previous_state == (transient or origin)
    assert closing_cause_for(transient or origin, origin) == cause

    for other in set(FINAL_AUDIT_EVENT) - {final}:
        with pytest.raises(InvalidTransitionError):
            run_transition(run, other, caller="tracer")
    run_transition(run, final, caller="tracer")
    fresh = Run.objects.get(pk=run.pk)
    assert fresh.state == final
    assert [(t.from_state, t.to_state) for t in Trace.objects.filter(run=run, kind="transition")][-2:] == [
        (transient or origin, "TRACING"), ("TRACING", final),
    ]
    assert AuditLog.objects.filter(run_id=run.pk, event=FINAL_AUDIT_EVENT[final]).count() == 1
    assert AuditLog.objects.filter(run_id=run.pk, event="invalid_transition").count() == 3


@postgres_only
@pytest.mark.django_db(transaction=True, databases=["default", "audit"])
def test_invalid_transition_row_survives_the_callers_rollback(make_run):
    run = make_run("EXECUTING")

    class CallerFailed(Exception):
        pass

    with pytest.raises(CallerFailed):
        with transaction.atomic():
            Run.objects.filter(pk=run.pk).update(title="written by the caller")
            with pytest.raises(InvalidTransitionError):
                run_transition(run, "CLOSED_FAILED", caller="careless caller")
            raise CallerFailed

    fresh = Run.objects.get(pk=run.pk)
    assert fresh.title == "", "the caller's transaction was not rolled back"
    assert fresh.state == "EXECUTING"
    row = AuditLog.objects.get(run_id=run.pk)
    assert (row.event, row.from_state, row.to_state, row.caller) == (
        "invalid_transition", "EXECUTING", "CLOSED_FAILED", "careless caller",
    )
    assert row.tenant_id == run.tenant_id


@transactional
def test_state_cannot_be_assigned_directly(make_run):
    run = make_run("EXECUTING")
    with pytest.raises(AttributeError):
        run.state = RunState.SUCCEEDED
    run.save()
    assert Run.objects.get(pk=run.pk).state == "EXECUTING"
    assert not AuditLog.objects.filter(run_id=run.pk).exists()


@transactional
def test_transition_with_a_stale_expectation_is_lost_and_audited(make_run):
    run = make_run("PLANNING")
    with pytest.raises(TransitionLost) as excinfo:
        run_transition(run, "POLICY_CHECK", caller="planner", expected="PREPARING")
    assert (excinfo.value.expected, excinfo.value.target, excinfo.value.current) == (
        "PREPARING", "POLICY_CHECK", "PLANNING",
    )
    fresh = Run.objects.get(pk=run.pk)
    assert (fresh.state, fresh.last_state_change_at) == ("PLANNING", run.last_state_change_at)
    assert not Trace.objects.filter(run=run).exists()
    assert not Event.objects.filter(run=run).exists()
    row = AuditLog.objects.get(run_id=run.pk)
    assert (row.event, row.from_state, row.to_state, row.caller) == (
        "transition_lost", "PREPARING", "POLICY_CHECK", "planner",
    )
    assert row.data["current_state"] == "PLANNING"


@transactional
def test_stale_instance_save_is_refused_by_the_optimistic_lock(make_run):
    run = make_run("CREATED")
    first, second = Run.objects.get(pk=run.pk), Run.objects.get(pk=run.pk)
    with transaction.atomic():
        first.to_preparing()
        first.save()
    with pytest.raises(ConcurrentTransition):
        with transaction.atomic():
            second.force_failed()
            second.save()
    assert Run.objects.get(pk=run.pk).state == "PREPARING"


def test_only_tracing_and_failed_can_be_entered_twice():
    """The sweeper's TRACING → FAILED → TRACING is the table's one cycle: a
    copy of a run read outside its lock in any other state is stale only if
    the run has moved on (``ENTERED_ONCE``, which the stages rely on)."""
    assert set(RunState) - ENTERED_ONCE == {RunState.TRACING, RunState.FAILED}
