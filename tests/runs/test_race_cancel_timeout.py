"""Final-state uniqueness under real concurrency (docs/state-machine.md#rules):
two writers on two database connections race for the same run; exactly one
wins, the loser's attempt is still in the AuditLog, and the reconciliation
holds.

Only meaningful on PostgreSQL: SQLite serialises writers."""

import threading
import time
from collections import Counter
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection, connections, transaction
from django.utils import timezone

from runs.closing import run_close
from runs.models import AuditLog, Job, Run, Step, Trace
from runs.services import run_cancel
from runs.settle import run_settle
from runs.transitions import TransitionLost, run_transition
from tests.conftest import postgres_only

pytestmark = [postgres_only, pytest.mark.django_db(transaction=True, databases=["default", "audit"])]

TRIALS = 200
FINAL_AUDIT_EVENTS = {"run_succeeded", "run_rejected", "run_failed", "run_cancelled"}




def race(**contenders) -> dict[str, str]:
    """Run each contender in its own thread and connection, released together.
    Returns ``{name: "won" | "lost"}``; any other exception fails the test."""
    barrier = threading.Barrier(len(contenders))
    outcomes: dict[str, object] = {}

    def contend(name, attempt):
        try:
            connection.ensure_connection()  # connect first, so the barrier times the writes
            barrier.wait(timeout=10)
            attempt()
            outcomes[name] = "won"
        except TransitionLost:
            outcomes[name] = "lost"
        except BaseException as exc:  # handed to the test thread below
            outcomes[name] = exc
        finally:
            connection.close()
            connections.close_all()

    threads = [threading.Thread(target=contend, args=item) for item in contenders.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive(), "a contender hung"
    for name, outcome in outcomes.items():
        if isinstance(outcome, BaseException):
            raise AssertionError(f"{name} failed") from outcome
    return outcomes


def audit_rows(run_id: int) -> list[tuple[str, str, str, str]]:
    return list(
        AuditLog.objects.filter(run_id=run_id).order_by("id").values_list("event", "caller", "from_state", "to_state")
    )


def transitions_of(run_id: int) -> list[tuple[str, str]]:
    return list(Trace.objects.filter(run_id=run_id, kind="transition").values_list("from_state", "to_state"))


def assert_reconciles() -> None:
    out = StringIO()
    call_command("execgo_reconcile", stdout=out, stderr=StringIO())
    assert "all invariants hold" in out.getvalue()


def test_cancel_and_timeout_race_has_exactly_one_winner(make_run):
    wins = Counter()
    for trial in range(TRIALS):
        run_id = make_run("EXECUTING", previous_state="POLICY_CHECK").pk
        Job.objects.filter(runs__pk=run_id).update(status="running")

        def cancel():
            run_transition(run_id, "CANCELLED", caller="user", expected="EXECUTING")
            run_close(run_id)

        def timeout():
            run_transition(run_id, "TIMEOUT", caller="tool controller", expected="EXECUTING")
            run_close(run_id)

        outcomes = race(cancel=cancel, timeout=timeout)
        assert sorted(outcomes.values()) == ["lost", "won"], f"trial {trial}: {outcomes}"
        winner = "cancel" if outcomes["cancel"] == "won" else "timeout"
        wins[winner] += 1
        won_to, won_by, lost_to, lost_by, final, event, cause = {
            "cancel": ("CANCELLED", "user", "TIMEOUT", "tool controller", "CLOSED_CANCELLED", "run_cancelled",
                       "cancelled"),
            "timeout": ("TIMEOUT", "tool controller", "CANCELLED", "user", "CLOSED_FAILED", "run_failed",
                        "run_timeout"),
        }[winner]

        run = Run.objects.get(pk=run_id)
        assert (run.state, run.closing_cause) == (final, cause), f"trial {trial}: {winner} won"
        rows = audit_rows(run_id)
        assert [row for row in rows if row[0] in FINAL_AUDIT_EVENTS] == [(event, "tracer", "TRACING", final)]
        assert ("state_changed", won_by, "EXECUTING", won_to) in rows
        assert rows.count(("transition_lost", lost_by, "EXECUTING", lost_to)) == 1
        assert len(rows) == 4, rows  # the winning edge, TRACING, the final edge, the loser's attempt
        assert transitions_of(run_id) == [("EXECUTING", won_to), (won_to, "TRACING"), ("TRACING", final)]
        assert Job.objects.get(runs__pk=run_id).status == "failed"

    assert sum(wins.values()) == TRIALS
    assert Run.objects.filter(state__in=["CLOSED_CANCELLED", "CLOSED_FAILED"]).count() == TRIALS
    assert AuditLog.objects.filter(event="transition_lost").count() == TRIALS
    assert_reconciles()


def test_cancel_and_approval_race_has_exactly_one_winner(make_run):
    trials = TRIALS // 2
    for trial in range(trials):
        run_id = make_run("AWAITING_HITL", previous_state="POLICY_CHECK").pk
        Job.objects.filter(runs__pk=run_id).update(status="running")

        def cancel():
            run_transition(run_id, "CANCELLED", caller="user", expected="AWAITING_HITL")
            run_close(run_id)

        def approve():
            run_transition(run_id, "EXECUTING", caller="hitl controller", expected="AWAITING_HITL")

        outcomes = race(cancel=cancel, approve=approve)
        assert sorted(outcomes.values()) == ["lost", "won"], f"trial {trial}: {outcomes}"
        run = Run.objects.get(pk=run_id)
        rows = audit_rows(run_id)
        if outcomes["cancel"] == "won":
            assert run.state == "CLOSED_CANCELLED"
            assert transitions_of(run_id) == [
                ("AWAITING_HITL", "CANCELLED"), ("CANCELLED", "TRACING"), ("TRACING", "CLOSED_CANCELLED"),
            ]
            assert rows.count(("transition_lost", "hitl controller", "AWAITING_HITL", "EXECUTING")) == 1
            assert [row for row in rows if row[0] in FINAL_AUDIT_EVENTS] == [
                ("run_cancelled", "tracer", "TRACING", "CLOSED_CANCELLED"),
            ]
        else:
            assert run.state == "EXECUTING"
            assert run.executing_started_at is not None
            assert transitions_of(run_id) == [("AWAITING_HITL", "EXECUTING")]
            assert rows == [
                ("state_changed", "hitl controller", "AWAITING_HITL", "EXECUTING"),
                ("transition_lost", "user", "AWAITING_HITL", "CANCELLED"),
            ]
            assert Job.objects.get(runs__pk=run_id).status == "running"
    assert_reconciles()


def test_cancel_request_racing_an_approval_is_never_dropped(make_run, agent):
    """Whichever of the user's cancel (the run_cancel service) and the
    approver's decision lands first, the cancel is honoured: directly from
    AWAITING_HITL, or by the executor's settle before any step runs."""
    for trial in range(TRIALS // 2):
        run = make_run("AWAITING_HITL", previous_state="POLICY_CHECK")
        Job.objects.filter(pk=run.job_id).update(status="running")
        step = Step.objects.create(run=run, step_id="a", position=0, tool="shell",
                                   params={"argv": ["true"]}, timeout_s=5)

        def cancel():
            run_cancel(run=Run.objects.get(pk=run.pk), user=agent)

        def approve():
            run_transition(run.pk, "EXECUTING", caller="hitl controller", expected="AWAITING_HITL")

        outcomes = race(cancel=cancel, approve=approve)
        assert outcomes["cancel"] == "won", "run_cancel absorbs a lost race"
        assert AuditLog.objects.filter(run_id=run.pk, event="cancel_requested").count() == 1
        if outcomes["approve"] == "won":
            fresh = Run.objects.get(pk=run.pk)
            assert fresh.cancel_requested_at is not None, f"trial {trial}: the approval erased the cancel request"
            run_settle(run.pk)  # what the executor does next with an EXECUTING run

        fresh = Run.objects.get(pk=run.pk)
        assert fresh.state == "CLOSED_CANCELLED", f"trial {trial}: {fresh.state}"
        assert fresh.cancel_requested_by_id == agent.pk
        assert Step.objects.get(pk=step.pk).attempt == 0, "a step was dispatched after the cancel"
        assert AuditLog.objects.filter(run_id=run.pk, event="run_cancelled").count() == 1
    assert_reconciles()


def test_transition_keeps_a_cancel_request_stored_after_it_read_the_run(make_run, agent):
    """The race above made deterministic: the approval has read the run and
    waits for the row lock while the cancel request is stored and committed."""
    run = make_run("AWAITING_HITL", previous_state="POLICY_CHECK")
    approver = {}

    def approve():
        try:
            approver["pid"] = connection.cursor().connection.info.backend_pid
            run_transition(run.pk, "EXECUTING", caller="hitl controller", expected="AWAITING_HITL")
            approver["outcome"] = "won"
        except BaseException as exc:
            approver["outcome"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=approve)
    with transaction.atomic():
        Run.objects.select_for_update().get(pk=run.pk)
        thread.start()
        wait_until_blocked_on_a_lock(approver)
        # run_cancel's first write (runs/services.py), committed while the approval waits.
        Run.objects.filter(pk=run.pk, cancel_requested_at__isnull=True).update(
            cancel_requested_at=timezone.now(), cancel_requested_by=agent,
        )
    thread.join(timeout=10)
    assert approver["outcome"] == "won"

    fresh = Run.objects.get(pk=run.pk)
    assert fresh.state == "EXECUTING"
    assert fresh.cancel_requested_at is not None, "the approval wrote back the cancel request it had read (none)"
    assert fresh.cancel_requested_by_id == agent.pk


def wait_until_blocked_on_a_lock(contender: dict) -> None:
    deadline = time.monotonic() + 10
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            if "outcome" in contender:
                raise AssertionError(f"the contender finished without waiting: {contender['outcome']!r}")
            if "pid" in contender:
                cursor.execute("SELECT 1 FROM pg_locks WHERE pid = %s AND NOT granted", [contender["pid"]])
                if cursor.fetchone():
                    return
            time.sleep(0.01)
    raise AssertionError("the contender never reached the row lock")
