"""The suite's guard against a test that ends with a run still going
(tests/conftest.py, ``celery_worker``): the shared worker outlives the
test, and its next writes would meet the flush after it."""

import pytest

from runs.statemachine import RunState
from tests.conftest import _fail_on_runs_in_flight

S = RunState


@pytest.mark.django_db
@pytest.mark.parametrize("state", [S.CREATED, S.EXECUTING, S.TRACING])
def test_a_run_still_going_fails_the_test_and_is_named(make_run, state):
    run = make_run(state)
    with pytest.raises(pytest.fail.Exception, match=rf"runs in flight \(run, state\): \[\({run.pk}, '{state}'\)\]"):
        _fail_on_runs_in_flight(grace_s=0.2)


@pytest.mark.django_db
def test_runs_that_ended_or_wait_for_a_person_pass(make_run):
    for state in (S.SUCCEEDED, S.CLOSED_FAILED, S.CLOSED_CANCELLED, S.CLOSED_REJECTED, S.AWAITING_HITL):
        make_run(state)
    _fail_on_runs_in_flight(grace_s=0.2)
