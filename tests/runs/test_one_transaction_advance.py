"""A static plan's stages commit as one transaction, the first step's start
included (runs/pipeline.py; docs/stages.md#driving-a-run): each transition
still has its own trace, event and audit row; an llm planner is called
between two transactions; a failure in a stage rolls the stages back and
the run is driven again from where it was. Inside that transaction a
transition takes no savepoint: a refused or lost one has written nothing,
and leaves the caller's transaction going.
"""

import re
import threading

import pytest
from django.conf import settings
from django.db import connection, connections, transaction

import runs.pipeline
import runs.transitions
from runs.execution import execute_claims
from runs.invariants import audit_chain_breaks
from runs.models import AuditLog, Event, EventType, Job, Run, Trace
from runs.pipeline import run_advance
from runs.services import run_submit
from runs.transitions import InvalidTransitionError, TransitionLost, run_transition
from tests.conftest import simple_plan
from tests.runs.test_llm_planner import GOAL, VALID_PLAN, plan_reply, serving_planner

pytestmark = pytest.mark.django_db(transaction=True)

STAGES = ["PREPARING", "PLANNING", "POLICY_CHECK", "EXECUTING"]


@pytest.fixture
def commits(monkeypatch):
    """How many transactions the default connection commits."""
    count = []
    real = connection._commit

    def counting():
        count.append(1)
        return real()

    monkeypatch.setattr(connection, "_commit", counting)
    return count


def recorded_per_transition(run_id: int) -> None:
    for state in STAGES:
        assert Trace.objects.filter(run_id=run_id, kind="transition", to_state=state).count() == 1
        assert AuditLog.objects.filter(run_id=run_id, to_state=state).count() == 1
        assert Event.objects.filter(run_id=run_id, type=EventType.RUN_STATE_CHANGED, data__to=state).count() == 1


def state_seen_by_another_connection(run_id: int) -> str:
    seen = []

    def read():
        try:
            seen.append(Run.objects.get(pk=run_id).state)
        finally:
            connections.close_all()

    reader = threading.Thread(target=read)
    reader.start()
    reader.join()
    return seen[0]


def advanced_with_its_statements(run_id: int):
    """``run_advance(run_id)``, and the SQL it sent, in order."""
    sent = []

    def recording(execute, sql, params, many, context):
        sent.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(recording):
        claim = run_advance(run_id)
    return claim, sent


def test_the_stages_and_the_first_step_s_start_commit_together(tenant, agent, commits):
    run_id = run_submit(tenant=tenant, user=agent, plan=simple_plan(["true"], ["true"])).run.pk
    commits.clear()
    claim = run_advance(run_id)
    assert len(commits) == 1
    assert claim is not None and claim.started is not None  # the first step, started in that transaction
    assert state_seen_by_another_connection(run_id) == "EXECUTING"
    recorded_per_transition(run_id)
    execute_claims(claim)
    assert Run.objects.get(pk=run_id).state == "SUCCEEDED"


def test_the_stages_events_get_their_ids_at_the_end_of_the_transaction(tenant, agent):
    """The live relay waits a bounded time for a lower id to commit
    (docs/live-relay.md): the events are written last, together, in order."""
    run_id = run_submit(tenant=tenant, user=agent, plan=simple_plan(["true"], ["true"])).run.pk
    claim, sent = advanced_with_its_statements(run_id)
    writes = [sql for sql in sent if sql.lstrip().upper().startswith(("INSERT", "UPDATE", "WITH", "DELETE"))]
    event_inserts = [index for index, sql in enumerate(writes) if 'INTO "runs_event"' in sql]
    # One insert, among the transaction's last writes: those of the records
    # held to its end (on PostgreSQL all of them are one statement).
    assert len(event_inserts) == 1, writes
    held_to_the_end = ('"runs_trace"', '"runs_auditlog"', '"runs_auditchainhead"', '"runs_job"')
    assert all(any(table in sql for table in held_to_the_end) for sql in writes[event_inserts[0] + 1:]), writes
    types = list(Event.objects.filter(run_id=run_id).order_by("id").values_list("type", "data__to"))
    assert types == [("run_state_changed", "CREATED"), *[("run_state_changed", state) for state in STAGES[:2]],
                     ("task_submitted", None), ("task_submitted", None),
                     *[("run_state_changed", state) for state in STAGES[2:]],
                     ("task_accepted", None), ("task_started", None)]  # the first step; the second waits for it
    execute_claims(claim)


@pytest.mark.skipif(settings.IS_SQLITE, reason="one statement of several writes is PostgreSQL's (WITH)")
def test_the_stages_records_take_two_round_trips_whatever_the_number_of_transitions(tenant, agent):
    """The traces, events, audit rows and job projection of the four
    transitions (and the tasks' submitted events) are held to the end of the
    transaction: one statement locks the audit chain's head, one writes the
    rest. Before, each transition sent five."""
    run_id = run_submit(tenant=tenant, user=agent, plan=simple_plan(["true"], ["true"])).run.pk
    claim, sent = advanced_with_its_statements(run_id)
    records = ('"runs_trace"', '"runs_event"', '"runs_auditlog"', '"runs_auditchainhead"', 'UPDATE "runs_job"')
    writes = [sql for sql in sent if any(table in sql for table in records) and not sql.lstrip().startswith("SELECT")]
    assert len(writes) == 2, writes
    assert "pg_try_advisory_xact_lock" in writes[0]
    assert all(table in writes[1] for table in records[:4]) and 'UPDATE "runs_job"' in writes[1]

    recorded_per_transition(run_id)
    traces = list(Trace.objects.filter(run_id=run_id, kind="transition").values_list("to_state", "created_at"))
    assert [state for state, _at in traces] == STAGES
    assert [at for _state, at in traces] == sorted(at for _state, at in traces)  # each at its change's time
    job = Job.objects.get(runs__pk=run_id)
    assert (job.status, job.run_state_snapshot["state"]) == ("running", "EXECUTING")
    assert audit_chain_breaks() == []
    execute_claims(claim)
    assert Run.objects.get(pk=run_id).state == "SUCCEEDED"


def test_an_llm_planner_is_called_between_two_transactions(tenant, agent, settings, monkeypatch):
    real_plan_run, seen_while_planning = runs.pipeline.plan_run, []

    def planning(run):
        seen_while_planning.append(state_seen_by_another_connection(run.pk))
        return real_plan_run(run)

    monkeypatch.setattr(runs.pipeline, "plan_run", planning)
    with serving_planner(settings) as llm:
        llm.script(plan_reply(VALID_PLAN))
        run_id = run_submit(tenant=tenant, user=agent, planner="llm", goal=GOAL).run.pk
        execute_claims(run_advance(run_id))
    assert seen_while_planning == ["PLANNING"]  # committed before the call, not held open across it
    assert Run.objects.get(pk=run_id).state == "SUCCEEDED"
    recorded_per_transition(run_id)


def test_a_failure_inside_a_stage_rolls_the_stages_back_and_the_run_is_driven_again(tenant, agent, monkeypatch):
    run_id = run_submit(tenant=tenant, user=agent, plan=simple_plan(["true"])).run.pk

    def broken(run, steps=None):
        raise RuntimeError("the policy store is unreachable")

    monkeypatch.setattr(runs.pipeline, "evaluate_policy", broken)
    with pytest.raises(RuntimeError):
        run_advance(run_id)
    assert Run.objects.get(pk=run_id).state == "CREATED"
    assert not Trace.objects.filter(run_id=run_id, to_state__in=STAGES).exists()
    assert not AuditLog.objects.filter(run_id=run_id, to_state__in=STAGES).exists()

    monkeypatch.undo()  # the task is delivered again
    execute_claims(run_advance(run_id))
    assert Run.objects.get(pk=run_id).state == "SUCCEEDED"
    recorded_per_transition(run_id)


def test_the_stages_take_no_savepoint_but_the_ledger_s_on_sqlite(tenant, agent):
    """Two round trips a block saved. Only the slot's reservation, which
    catches a concurrent reserve of the same handle, keeps its savepoint on
    SQLite; on PostgreSQL it is one statement (ON CONFLICT DO NOTHING)."""
    first = run_submit(tenant=tenant, user=agent, plan=simple_plan(["true"])).run.pk
    execute_claims(run_advance(first))  # its step registers this host's capacity (a savepoint of its own)
    run_id = run_submit(tenant=tenant, user=agent, plan=simple_plan(["true"])).run.pk
    claim, sent = advanced_with_its_statements(run_id)
    savepoints = [sql.split()[0] for sql in sent if "SAVEPOINT" in sql.upper()]
    assert savepoints == (["SAVEPOINT", "RELEASE"] if settings.IS_SQLITE else []), savepoints
    reservations = [sql for sql in sent if '"runtime_reservation"' in sql]
    assert len(reservations) == (2 if settings.IS_SQLITE else 1), reservations  # (SQLite: a read, then the insert)
    recorded_per_transition(run_id)
    execute_claims(claim)
    assert Run.objects.get(pk=run_id).state == "SUCCEEDED"


def test_the_stages_read_the_run_once_whatever_the_number_of_transitions(tenant, agent):
    """At the start. The first transition moves that copy (read in a state a
    run enters only once, which its UPDATE re-checks, taking the run's row
    lock); the next transitions move the copy the last one saved."""
    run_id = run_submit(tenant=tenant, user=agent, plan=simple_plan(["true"])).run.pk
    claim, sent = advanced_with_its_statements(run_id)
    # The whole row (bulky fields deferred), by its id: the stages' reads of the
    # run (settle's lock reads only what a decision needs: not the title).
    run_reads = [sql for sql in sent if sql.startswith("SELECT") and '"title"' in sql
                 and re.search(r'FROM "runs_run" WHERE ("runs_run"\.)?"id" = %s', sql)]
    assert len(run_reads) == 1, run_reads
    recorded_per_transition(run_id)
    execute_claims(claim)
    assert Run.objects.get(pk=run_id).state == "SUCCEEDED"


def moving_it_first(monkeypatch, move) -> None:
    """Another writer moves the run after a transition has read it and
    before it writes (``move``, once)."""
    real, calls = runs.transitions.is_legal, []

    def racing(*args, **kwargs):
        if not calls:
            calls.append(1)
            move()
        return real(*args, **kwargs)

    monkeypatch.setattr(runs.transitions, "is_legal", racing)


@pytest.mark.django_db(transaction=True, databases=["default", "audit"])
def test_a_refused_or_lost_transition_leaves_the_caller_s_transaction_going(make_run, monkeypatch):
    run = make_run("CREATED", title="before")
    with transaction.atomic():
        Run.objects.filter(pk=run.pk).update(title="kept")
        with pytest.raises(TransitionLost):
            run_transition(run, "PLANNING", expected="PREPARING")  # it is CREATED
        with pytest.raises(InvalidTransitionError):
            run_transition(run, "SUCCEEDED")
        # The optimistic lock: the run moved between the read and the write.
        moving_it_first(monkeypatch, lambda: Run.objects.filter(pk=run.pk).update(state="PREPARING"))
        with pytest.raises(TransitionLost) as lost:
            run_transition(run, "PREPARING", expected="CREATED")
        assert lost.value.current == "PREPARING"
        monkeypatch.undo()
        moved = run_transition(run, "PLANNING", expected="PREPARING")  # the transaction goes on
    assert moved.state == "PLANNING"
    assert Run.objects.values_list("state", "title").get(pk=run.pk) == ("PLANNING", "kept")
    events = list(AuditLog.objects.filter(run_id=run.pk).values_list("event", flat=True))
    assert events.count("transition_lost") == 2 and events.count("invalid_transition") == 1, events
    assert Trace.objects.filter(run_id=run.pk, kind="transition").count() == 1  # none of the refused ones


@pytest.mark.skipif(settings.IS_SQLITE, reason="SQLite's stages hold the write lock from their first read")
@pytest.mark.django_db(transaction=True, databases=["default", "audit"])
def test_a_run_moved_by_another_writer_before_the_first_stage_writes_is_left_to_it(tenant, agent, monkeypatch):
    """The first stage reads the run without a lock; a writer that moves it
    before the stage's first write wins, and the stages' transaction rolls
    back whole (nothing of it was written before the lost transition)."""
    run_id = run_submit(tenant=tenant, user=agent, plan=simple_plan(["true"])).run.pk

    def another_writer():
        try:
            run_transition(run_id, "PREPARING", expected="CREATED", caller="another worker")
        finally:
            connections.close_all()

    def move():
        writer = threading.Thread(target=another_writer)
        writer.start()
        writer.join()

    moving_it_first(monkeypatch, move)
    assert run_advance(run_id) is None
    assert Run.objects.get(pk=run_id).state == "PREPARING"
    assert list(Trace.objects.filter(run_id=run_id, kind="transition").values_list("to_state", "data__caller")) == [
        ("PREPARING", "another worker")]
    assert AuditLog.objects.filter(run_id=run_id, event="transition_lost", to_state="PREPARING").count() == 1
    monkeypatch.undo()
    execute_claims(run_advance(run_id))  # the task delivered again drives it on
    assert Run.objects.get(pk=run_id).state == "SUCCEEDED"
