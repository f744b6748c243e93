"""Approve with edits through the decision service: the edited plan is
validated and rated again; a denied or invalid edit changes nothing; an
accepted one replaces the steps and binds the approval to its digest."""

import pytest

from approvals.models import ApprovalRequest, action_digest
from approvals.services import approval_decide
from runs.errors import ExecGoError
from runs.models import Run
from runs.pipeline import run_advance
from runs.services import run_submit
from tests.conftest import make_user, simple_plan


@pytest.fixture
def approver(tenant):
    return make_user("ann", tenant, groups=("approvers",))


@pytest.fixture
def waiting(seeded_policy, echo_pip_install_is_high, tenant, agent, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=False):  # no worker here: nothing is sent
        run = run_submit(tenant=tenant, user=agent, plan=simple_plan(["echo", "pip", "install", "all"])).run
        run_advance(run.pk)
    return ApprovalRequest.objects.get(run=run, status="pending")


def decide(approval, approver, edits, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=False):
        return approval_decide(request=approval, digest=approval.action_digest, actor=approver, approve=True, edits=edits)


@pytest.mark.django_db
def test_a_denied_edit_is_refused_with_its_reason_and_changes_nothing(waiting, approver,
                                                                     django_capture_on_commit_callbacks):
    before = (waiting.action_digest, list(waiting.run.steps.values_list("params", flat=True)))
    with pytest.raises(ExecGoError) as denied:
        decide(waiting, approver, {"s0": {"argv": ["sudo", "true"]}}, django_capture_on_commit_callbacks)
    assert denied.value.envelope["code"] == "denied"
    assert "shell-sudo" in denied.value.envelope["message"]
    waiting.refresh_from_db()
    assert waiting.status == "pending" and not waiting.decisions.exists()
    assert (waiting.action_digest, list(waiting.run.steps.values_list("params", flat=True))) == before


@pytest.mark.django_db
@pytest.mark.parametrize("edits, words", [
    ({"s0": {"cwd": "/"}}, "only argv, script may be edited"),
    ({"nope": {"argv": ["true"]}}, "no such step"),
    ({"s0": {"argv": []}}, "not valid"),
])
def test_an_invalid_edit_is_refused(waiting, approver, edits, words, django_capture_on_commit_callbacks):
    with pytest.raises(ExecGoError) as refused:
        decide(waiting, approver, edits, django_capture_on_commit_callbacks)
    assert refused.value.envelope["code"] == "invalid_input" and words in refused.value.envelope["message"]
    assert ApprovalRequest.objects.get(pk=waiting.pk).status == "pending"


@pytest.mark.django_db
def test_an_accepted_edit_replaces_the_step_and_rebinds_the_digest(waiting, approver,
                                                                  django_capture_on_commit_callbacks):
    outcome = decide(waiting, approver, {"s0": {"argv": ["echo", "narrowed"]}}, django_capture_on_commit_callbacks)

    approval = ApprovalRequest.objects.get(pk=waiting.pk)
    run = Run.objects.get(pk=waiting.run_id)
    steps = list(run.steps.order_by("position"))
    assert outcome.request.status == "approved" and run.state == "EXECUTING"
    assert steps[0].params["argv"] == ["echo", "narrowed"]
    assert run.plan["steps"][0]["params"]["argv"] == ["echo", "narrowed"]
    assert approval.action_digest == action_digest(steps, approval.policy_version) != waiting.action_digest
    assert approval.original_steps[0]["action"]["argv"] == ["echo", "pip", "install", "all"]
    assert approval.edited_by == approver and approval.decisions.get().edits == {"s0": {"argv": ["echo", "narrowed"]}}
    trace = run.traces.get(kind="hitl_decision")
    assert trace.data["edited_by"] == "ann" and trace.data["edits"] == {"s0": {"argv": ["echo", "narrowed"]}}


@pytest.mark.django_db
def test_edits_come_with_the_first_decision_only(waiting, approver, tenant, django_capture_on_commit_callbacks):
    ApprovalRequest.objects.filter(pk=waiting.pk).update(approvals_required=2)
    decide(waiting, approver, None, django_capture_on_commit_callbacks)
    second = make_user("bob", tenant, groups=("approvers",))
    with pytest.raises(ExecGoError) as refused:
        decide(waiting, second, {"s0": {"argv": ["echo", "narrowed"]}}, django_capture_on_commit_callbacks)
    assert refused.value.http_status == 409
    assert ApprovalRequest.objects.get(pk=waiting.pk).approvals_so_far == 1
