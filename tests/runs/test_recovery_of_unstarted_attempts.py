"""A worker that dies between claiming an attempt (the step is running in
the database) and preparing it on disk leaves nothing to re-attach to: the
restarted worker fails that attempt as retryable, instead of leaving the
step running until the run's deadline, and retries it even when the step
has no retries of its own (nothing ran), up to EXECGO_UNSTARTED_RETRIES."""

import pytest

from runs.execution import step_reattach
from runs.models import AuditLog, Event, Run, Step, StepRunStatus, StepStatus
from runtime import layout
from tests.conftest import purge_broker
from tests.runs.conftest import start_attempt

pytestmark = pytest.mark.django_db(transaction=True)


def claimed_but_never_prepared(make_run, *, retries: int) -> Step:
    run = make_run("EXECUTING")
    step = start_attempt(Step.objects.create(run=run, step_id="a", position=0, tool="shell",
                                             params={"argv": ["true"]}, timeout_s=5, retries=retries))
    assert not layout.task_dir(step.handle_id).exists()
    return step


def test_the_attempt_fails_as_retryable_and_is_retried_without_retries_of_its_own(make_run):
    step = claimed_but_never_prepared(make_run, retries=0)

    assert step_reattach(step.pk, 1) is None
    purge_broker()  # the retry was enqueued; this test only reads the claim

    step.refresh_from_db()
    assert (step.status, step.run_status, step.attempt) == (StepStatus.RUNNING, StepRunStatus.ACCEPTED, 2)
    assert Run.objects.get(pk=step.run_id).state == "EXECUTING"
    failed = Event.objects.get(run_id=step.run_id, type="task_failed")
    assert "never started" in failed.message
    retried = Event.objects.get(run_id=step.run_id, type="task_retried")
    assert retried.data["error"]["retryable"] is True
    assert retried.data["error"]["details"]["started"] is False
    assert AuditLog.objects.filter(run_id=step.run_id, event="step_reattached",
                                   data__status=StepRunStatus.FAILED).exists()


def test_an_attempt_that_never_starts_again_and_again_fails_the_run(make_run, settings):
    settings.EXECGO_UNSTARTED_RETRIES = 1
    step = claimed_but_never_prepared(make_run, retries=0)
    step_reattach(step.pk, 1)
    purge_broker()
    step = start_attempt(Step.objects.get(pk=step.pk), attempt=2)

    assert step_reattach(step.pk, 2) is None

    step.refresh_from_db()
    assert (step.status, step.run_status, step.attempt) == (StepStatus.FAILED, StepRunStatus.FAILED, 2)
    assert step.result["error"]["code"] == "internal"
    assert "never started" in step.result["error"]["message"]
    assert Run.objects.get(pk=step.run_id).state == "CLOSED_FAILED"


def test_a_step_with_retries_left_is_retried(make_run):
    step = claimed_but_never_prepared(make_run, retries=1)

    step_reattach(step.pk, 1)
    purge_broker()  # the retry was enqueued; this test only reads the claim

    step.refresh_from_db()
    assert (step.status, step.run_status, step.attempt) == (StepStatus.RUNNING, StepRunStatus.ACCEPTED, 2)
    assert Run.objects.get(pk=step.run_id).state == "EXECUTING"
