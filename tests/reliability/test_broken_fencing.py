"""The history checker catches a deliberately broken build.

A step attempt whose message is delivered twice (a broker redelivering
it, the sweeper sending a stuck run's work again) runs once: the second
delivery finds the attempt claimed and does nothing. With
``EXECGO_TEST_SKIP_FENCING`` the worker skips that fence, so the step's
side effect (a POST to the loopback recorder) happens twice — and the
checker, which knows nothing of the switch, says so. The same scenario on
the real build is the control: one side effect, a clean history.
"""

import pytest

from approvals.models import ApprovalRequest
from runs.dataplane import queue_for
from runs.models import Step
from runs.services import run_submit
from runs.tasks import execute_step
from tests.conftest import WorkerProcess, log_tails, make_user, token_client, wait_for_run, wait_until
from tests.reliability.checker import check_history
from tests.reliability.recorder import EffectRecorder
from tests.reliability.workload import effect

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("broken", [False, True], ids=["fenced", "fencing-skipped"])
def test_a_step_delivered_twice_runs_once_and_a_build_that_skips_fencing_is_caught(broken, tenant, agent, tmp_path):
    approver = token_client(make_user("ann", tenant, groups=("approvers",)))
    with EffectRecorder(delay_s=3.0) as recorder:  # the attempt is in flight when its message comes again
        env = {"EXECGO_HTTP_ALLOWED_NETWORKS": recorder.network}
        if broken:
            env["EXECGO_TEST_SKIP_FENCING"] = "true"
        worker = WorkerProcess(hostname="fencing", env=env).start()
        try:
            run_id = run_submit(tenant=tenant, user=agent, plan={"steps": [
                effect("effect", recorder.url("only/effect"))]}).run.pk
            wait_until(lambda: ApprovalRequest.objects.filter(run_id=run_id, status="pending").exists(),
                       timeout=60, what="the POST waiting for an approver")
            request = ApprovalRequest.objects.get(run_id=run_id)
            decided = approver.post(f"/api/v1/approvals/{request.pk}/approve", {"digest": request.action_digest},
                                    format="json")
            assert decided.status_code == 200, decided.content

            wait_until(lambda: recorder.count("only/effect") >= 1, timeout=60, what="the step's POST")
            step = Step.objects.get(run_id=run_id)
            # While the attempt runs, its message comes again.
            again = execute_step.apply_async((step.pk, step.attempt), queue=queue_for(step))
            run = wait_for_run(run_id, timeout=60)
            wait_until(lambda: f"execute_step[{again.id}] succeeded" in worker.log_path.read_text(), timeout=60,
                       what="the second delivery handled")
        except (AssertionError, pytest.fail.Exception) as exc:
            raise AssertionError(f"{exc}{log_tails(worker)}") from exc
        finally:
            worker.stop()
        effects = {(run_id, "effect"): recorder.count("only/effect")}

    violations = check_history([run_id], side_effects=effects, export_dir=tmp_path)
    if broken:
        assert effects[run_id, "effect"] == 2
        assert violations == [f"run {run_id} step effect: its side effect happened 2 times in 1 started attempts"]
    else:
        assert run.state == "SUCCEEDED"
        assert effects[run_id, "effect"] == 1
        assert violations == []


def test_the_switch_is_refused_outside_the_fault_tests(settings):
    """``manage.py check`` and every management command fail while it is set."""
    from django.core import checks

    settings.EXECGO_TEST_SKIP_FENCING = True
    errors = [message for message in checks.run_checks(tags=[checks.Tags.security]) if message.id == "execgo.E001"]
    assert [error.level for error in errors] == [checks.ERROR]
    settings.EXECGO_TEST_SKIP_FENCING = False
    assert not [message for message in checks.run_checks(tags=[checks.Tags.security]) if message.id == "execgo.E001"]
