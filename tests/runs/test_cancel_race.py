"""A cancel racing a run's natural end is decided under the run's row lock.

202 only when the request was stored on a run still on its way (its body
shows that state); a cancel that loses to the end is a 409 envelope, writes
nothing to the run and leaves exactly one audit row after the final one
(``cancel_superseded``, or ``cancel_refused`` when the caller already saw the
run final). The race itself is only meaningful on PostgreSQL."""

import random
import threading
from collections import Counter

import pytest
from django.db import connection, connections
from django.utils import timezone

from runs.errors import ConflictError
from runs.execution import step_finish
from runs.models import AuditLog, Event, Run, Step
from runs.services import run_cancel
from runtime.envelopes import step_result
from tests.conftest import postgres_only, token_client
from tests.runs.conftest import start_attempt

TRIALS = 100
FINAL_AUDIT_EVENTS = {"run_succeeded", "run_rejected", "run_failed", "run_cancelled"}
REFUSALS = {"cancel_superseded", "cancel_refused"}


def running_run(make_run) -> tuple[Run, Step]:
    """A run in EXECUTING whose only step's attempt is running."""
    run = make_run("EXECUTING", previous_state="POLICY_CHECK")
    step = Step.objects.create(run=run, step_id="a", position=0, tool="shell", params={"argv": ["true"]},
                               timeout_s=5)
    return run, start_attempt(step)


def finish(step: Step) -> None:
    """The attempt's success applied: settle takes EXECUTING → TRACING, the
    tracer TRACING → SUCCEEDED (or the run's cancel is honoured first)."""
    now = timezone.now()
    step_finish(step, 1, step_result(status="success", handle_id=step.handle_id, output={"ok": True},
                                     started_at=step.started_at, finished_at=now, attempt=1))


def after_final(run_id: int) -> tuple[list[str], list[str]]:
    """The audit events and the outbox event types written after the run's final audit row / final event."""
    audits = list(AuditLog.objects.filter(run_id=run_id).order_by("id").values_list("id", "event"))
    final_ids = [pk for pk, event in audits if event in FINAL_AUDIT_EVENTS]
    assert len(final_ids) == 1, audits
    events = list(Event.objects.filter(run_id=run_id).order_by("id").values_list("type", "data"))
    final_event = max(i for i, (kind, data) in enumerate(events) if kind == "run_state_changed"
                      and data["to"] in {"SUCCEEDED", "CLOSED_CANCELLED", "CLOSED_FAILED", "CLOSED_REJECTED"})
    return [event for pk, event in audits if pk > final_ids[0]], [kind for kind, _ in events[final_event + 1:]]


def assert_refused_and_untouched(run_id: int, response, agent) -> None:
    assert response.status_code == 409, response.content
    error = response.json()["error"]
    assert (error["code"], error["source"], error["retryable"]) == ("invalid_input", "api", False)
    # Refused under the lock while the tracer was closing it, or once it was final.
    assert error["details"] in ({"state": "TRACING", "reason": "run_closing"},
                                {"state": "SUCCEEDED", "reason": "run_final"}), error
    run = Run.objects.get(pk=run_id)
    assert run.state == "SUCCEEDED"
    assert (run.cancel_requested_at, run.cancel_requested_by_id) == (None, None), "a cancel was stamped on a final run"
    assert run.finished_at == run.last_state_change_at
    audits, events = after_final(run_id)
    assert set(audits) <= REFUSALS, audits
    assert events == [], "an event was written to a final run"
    refusal = AuditLog.objects.get(run_id=run_id, event__in=REFUSALS)  # exactly one
    assert (refusal.actor_id, refusal.from_state) == (agent.pk, error["details"]["state"])
    assert not AuditLog.objects.filter(run_id=run_id, event="cancel_requested").exists()


@pytest.mark.django_db
def test_a_cancel_read_before_the_run_ended_is_409_superseded_and_writes_nothing(make_run, agent):
    """The issue's race made deterministic: the caller's copy says EXECUTING,
    the run has SUCCEEDED since."""
    run, step = running_run(make_run)
    stale = Run.objects.get(pk=run.pk)
    finish(step)
    assert Run.objects.get(pk=run.pk).state == "SUCCEEDED"

    with pytest.raises(ConflictError) as refused:
        run_cancel(run=stale, user=agent)
    assert refused.value.envelope["details"] == {"state": "SUCCEEDED", "reason": "run_final"}
    fresh = Run.objects.get(pk=run.pk)
    assert (fresh.cancel_requested_at, fresh.cancel_requested_by_id) == (None, None)
    audits, events = after_final(run.pk)
    assert (audits, events) == (["cancel_superseded"], [])
    row = AuditLog.objects.get(run_id=run.pk, event="cancel_superseded")
    assert (row.actor_id, row.from_state, row.data["reason"]) == (
        agent.pk, "SUCCEEDED", "it ended before the cancel could be stored")


@pytest.mark.django_db
@pytest.mark.parametrize("state,cause", [("TRACING", "succeeded"), ("TRACING", "failed"), ("FAILED", ""),
                                         ("REJECTED", ""), ("TIMEOUT", "")])
def test_a_cancel_of_a_run_whose_ending_is_decided_is_409_and_stores_nothing(api, make_run, agent, state, cause):
    run = make_run(state, previous_state="EXECUTING", closing_cause=cause)
    response = api.post(f"/api/v1/runs/{run.pk}/cancel")
    assert response.status_code == 409
    assert response.json()["error"]["details"] == {"state": state, "reason": "run_closing"}
    fresh = Run.objects.get(pk=run.pk)
    assert (fresh.state, fresh.cancel_requested_at) == (state, None)
    assert list(AuditLog.objects.filter(run=run).values_list("event", "from_state")) == [("cancel_superseded", state)]
    assert not Event.objects.filter(run=run).exists()


@pytest.mark.django_db
def test_a_cancel_of_a_run_being_cancelled_is_202_and_stored_once(api, make_run, agent):
    run = make_run("TRACING", previous_state="CANCELLED", closing_cause="cancelled")
    first = api.post(f"/api/v1/runs/{run.pk}/cancel")
    stamped = Run.objects.get(pk=run.pk).cancel_requested_at
    second = api.post(f"/api/v1/runs/{run.pk}/cancel")
    assert (first.status_code, second.status_code) == (202, 202)
    assert first.json()["state"] == second.json()["state"] == "TRACING"
    assert Run.objects.get(pk=run.pk).cancel_requested_at == stamped is not None


@pytest.mark.django_db
def test_the_cancel_button_of_a_run_that_ended_shows_a_message(client, make_run, agent):
    run, step = running_run(make_run)
    finish(step)
    client.force_login(agent)
    response = client.post(f"/runs/{run.pk}/cancel", follow=True)
    assert response.status_code == 200
    assert [str(m) for m in response.context["messages"]] == [
        f"run {run.pk} is already SUCCEEDED; nothing to cancel"]
    assert Run.objects.get(pk=run.pk).cancel_requested_at is None


@pytest.mark.django_db
def test_the_cancel_button_of_a_closing_run_shows_a_message(client, make_run, agent):
    run = make_run("TRACING", previous_state="EXECUTING", closing_cause="succeeded")
    client.force_login(agent)
    response = client.post(f"/runs/{run.pk}/cancel", follow=True)
    assert response.status_code == 200
    assert [str(m) for m in response.context["messages"]] == [
        f"run {run.pk} is already TRACING; its ending was decided before the cancel could be stored"]
    assert Run.objects.get(pk=run.pk).cancel_requested_at is None
    assert AuditLog.objects.get(run=run).event == "cancel_superseded"


@postgres_only
@pytest.mark.django_db(transaction=True, databases=["default", "audit"])
def test_cancel_racing_the_natural_end_never_answers_202_for_a_run_that_ended(make_run, agent):
    """The run's last attempt succeeds in one thread (its own connection)
    while the agent's cancel arrives over the API in another."""
    outcomes = Counter()
    rng = random.Random(20261201)
    for trial in range(TRIALS):
        run, step = running_run(make_run)
        api = token_client(agent)
        api.get("/api/v1/runs")  # token looked up once: the race times the cancel, not the first request
        barrier = threading.Barrier(2)
        results: dict[str, object] = {}
        # One side starts late by a varying margin (the end when positive),
        # so the cancel lands before, during and after the end.
        delay = rng.uniform(-0.010, 0.010)

        def contend(name, attempt):
            try:
                connection.ensure_connection()
                barrier.wait(timeout=10)
                results[name] = attempt()
            except BaseException as exc:  # handed to the test thread below
                results[name] = exc
            finally:
                connections.close_all()

        def end():
            threading.Event().wait(max(delay, 0))
            finish(step)

        def cancel():
            threading.Event().wait(max(-delay, 0))
            return api.post(f"/api/v1/runs/{run.pk}/cancel")

        threads = [threading.Thread(target=contend, args=("end", end)),
                   threading.Thread(target=contend, args=("cancel", cancel))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
            assert not thread.is_alive(), f"trial {trial}: a contender hung"
        for name, result in results.items():
            if isinstance(result, BaseException):
                raise AssertionError(f"trial {trial}: {name} failed") from result

        response = results["cancel"]
        fresh = Run.objects.get(pk=run.pk)
        if response.status_code == 202:
            body = response.json()
            assert body["state"] == "EXECUTING", f"trial {trial}: 202 for a run in {body['state']}"
            assert body["cancel_requested_at"] is not None
            assert fresh.state == "CLOSED_CANCELLED", f"trial {trial}: a stored cancel was dropped ({fresh.state})"
            assert fresh.cancel_requested_by_id == agent.pk
            assert fresh.cancel_requested_at <= fresh.finished_at
            assert after_final(run.pk) == ([], [])
            assert not AuditLog.objects.filter(run_id=run.pk, event__in=REFUSALS).exists()
            outcomes["202, cancelled"] += 1
        else:
            assert_refused_and_untouched(run.pk, response, agent)
            outcomes[f"409, {response.json()['error']['details']['reason']}"] += 1

    print(f"{TRIALS} trials: {dict(outcomes)}")
    assert sum(outcomes.values()) == TRIALS
    assert Run.objects.filter(state="SUCCEEDED", cancel_requested_at__isnull=False).count() == 0
    succeeded = Run.objects.filter(state="SUCCEEDED").count()
    assert AuditLog.objects.filter(event__in=REFUSALS).count() == succeeded, "a dropped cancel went unaudited"
