"""A decision is bound to the view it was made on, and an edit never lowers
what a request needs: the stale-view and the edit-escalation scenarios
through the API, and the edited plan is exactly what runs."""

import pytest

from approvals.models import ApprovalRequest, Decision
from policy.models import PolicyRule
from policy.rules import policy_rule_save
from runs.models import AuditLog, Run
from runs.pipeline import run_advance
from runs.services import run_submit
from tests.conftest import make_user, simple_plan, token_client, wait_for_run
from tests.runs.test_llm_planner import plan_reply, serving_planner


@pytest.fixture
def two_approvers_for_deploys(db):
    """A harmless command a rule rates high and wants two approvers for."""
    policy_rule_save(PolicyRule(name="test-two-approvers", tool="shell", field="words", pattern=r"^echo deploy",
                                outcome="high", reason="a deploy needs two people", priority=1, approvals_required=2))


@pytest.fixture
def people(tenant):
    return [make_user(name, tenant, groups=("approvers",)) for name in ("ann", "ben", "cat")]


def waiting_run(tenant, agent, argv, django_capture_on_commit_callbacks) -> ApprovalRequest:
    with django_capture_on_commit_callbacks(execute=False):  # no worker here: nothing is sent
        run = run_submit(tenant=tenant, user=agent, plan=simple_plan(argv)).run
        run_advance(run.pk)
    return ApprovalRequest.objects.get(run=run, status="pending")


def approve(user, approval_id: int, digest: str, **body):
    return token_client(user).post(f"/api/v1/approvals/{approval_id}/approve", {"digest": digest, **body},
                                   format="json")


@pytest.mark.django_db
def test_a_decision_on_a_view_of_a_plan_that_changed_is_a_stale_view(
        seeded_policy, echo_pip_install_is_high, tenant, agent, people, django_capture_on_commit_callbacks):
    """Two approvers needed. ann opens the request; ben approves with edits;
    ann then submits the view she opened: refused, nothing recorded."""
    ann, ben, _ = people
    approval = waiting_run(tenant, agent, ["echo", "pip", "install", "all"], django_capture_on_commit_callbacks)
    ApprovalRequest.objects.filter(pk=approval.pk).update(approvals_required=2)
    seen_by_ann = token_client(ann).get(f"/api/v1/approvals/{approval.pk}").json()["action_digest"]

    with django_capture_on_commit_callbacks(execute=False):
        edited = approve(ben, approval.pk, seen_by_ann, edits={"s0": {"argv": ["echo", "pip", "install", "one"]}})
    assert edited.status_code == 200, edited.content
    assert (edited.json()["status"], edited.json()["approvals"]) == ("pending", 1)
    current = edited.json()["action_digest"]
    assert current != seen_by_ann

    stale = approve(ann, approval.pk, seen_by_ann)
    assert stale.status_code == 409
    error = stale.json()["error"]
    assert error["details"]["reason"] == "stale_view" and error["details"]["digest"] == current
    assert error["message"] == "the plan changed since you opened it: reload"
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "pending"
    assert not Decision.objects.filter(request=approval, decider=ann).exists()
    [row] = AuditLog.objects.filter(event="approval_stale_view", run_id=approval.run_id)
    assert (row.actor_id, row.data["seen_digest"], row.data["digest"]) == (ann.pk, seen_by_ann, current)

    with django_capture_on_commit_callbacks(execute=False):
        fresh = approve(ann, approval.pk, current)
    assert (fresh.status_code, fresh.json()["status"]) == (200, "approved")
    assert set(Decision.objects.filter(request=approval).values_list("digest", flat=True)) == {current}


@pytest.mark.django_db
@pytest.mark.parametrize("missing", [{}, {"digest": ""}, {"digest": "x" * 64}])
def test_a_decision_without_the_digest_it_was_made_on_is_refused(
        seeded_policy, echo_pip_install_is_high, tenant, agent, people, missing, django_capture_on_commit_callbacks):
    approval = waiting_run(tenant, agent, ["echo", "pip", "install", "all"], django_capture_on_commit_callbacks)
    response = token_client(people[0]).post(f"/api/v1/approvals/{approval.pk}/approve", missing, format="json")
    assert response.status_code in (400, 409)
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "pending" and not Decision.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_an_edit_that_raises_the_quorum_needs_another_approver_and_the_edited_plan_runs(
        seeded_policy, echo_pip_install_is_high, two_approvers_for_deploys, tenant, agent, people, celery_worker):
    """A one-approver request edited into a command a two-approver rule
    rates: the editor's approval counts once; the request waits for a
    second approver of the edited plan; the run executes exactly that."""
    ann, ben, _ = people
    run = run_submit(tenant=tenant, user=agent, plan=simple_plan(["echo", "pip", "install", "all"])).run
    wait_for_run(run.pk, states={"AWAITING_HITL"}, timeout=60)
    approval = ApprovalRequest.objects.get(run=run, status="pending")
    assert approval.approvals_required == 1

    edited = approve(ann, approval.pk, approval.action_digest, edits={"s0": {"argv": ["echo", "deploy", "prod"]}})
    assert edited.status_code == 200, edited.content
    body = edited.json()
    assert (body["status"], body["approvals"], body["approvals_required"]) == ("pending", 1, 2)
    assert [version["kind"] for version in body["versions"]] == ["proposed", "edited"]
    assert body["versions"][1]["by"] == "ann" and body["versions"][1]["digest"] == body["action_digest"]
    assert Run.objects.get(pk=run.pk).state == "AWAITING_HITL"
    again = approve(ann, approval.pk, body["action_digest"])  # the editor counts once
    assert again.status_code == 409 and "already decided" in again.json()["error"]["message"]

    second = approve(ben, approval.pk, body["action_digest"])
    assert (second.status_code, second.json()["status"]) == (200, "approved")
    finished = wait_for_run(run.pk, timeout=60)
    assert finished.state == "SUCCEEDED"
    step = finished.steps.get()
    assert step.params["argv"] == ["echo", "deploy", "prod"]
    assert step.result["output"]["stdout"] == "deploy prod\n"
    # The API's plan is what ran; what the agent sent is kept beside it.
    body = token_client(agent).get(f"/api/v1/runs/{run.pk}").json()
    assert body["plan"]["steps"][0]["params"]["argv"] == ["echo", "deploy", "prod"]
    assert body["submitted_plan"]["steps"][0]["params"]["argv"] == ["echo", "pip", "install", "all"]
    assert body["steps"][0]["rated_plan"]["profile"] == body["steps"][0]["effective_plan"]["profile"]


@pytest.mark.django_db
def test_an_edit_of_an_llm_planners_plan_is_what_the_api_says_will_run(
        seeded_policy, echo_pip_install_is_high, tenant, agent, people, settings,
        django_capture_on_commit_callbacks):
    """run.plan is what will run whichever planner made it: an approver's
    edit of the llm planner's plan shows in it; the goal stays what was sent."""
    planned = {"steps": [{"id": "s0", "tool": "shell", "params": {"argv": ["echo", "pip", "install", "all"]}}]}
    with serving_planner(settings) as planner, django_capture_on_commit_callbacks(execute=False):
        planner.script(plan_reply(planned))
        run = run_submit(tenant=tenant, user=agent, planner="llm", goal="install the packages").run
        run_advance(run.pk)
    approval = ApprovalRequest.objects.get(run=run, status="pending")
    assert Run.objects.get(pk=run.pk).plan["steps"][0]["params"]["argv"] == ["echo", "pip", "install", "all"]

    with django_capture_on_commit_callbacks(execute=False):
        edited = approve(people[0], approval.pk, approval.action_digest,
                         edits={"s0": {"argv": ["echo", "pip", "install", "one"]}})
    assert (edited.status_code, edited.json()["status"]) == (200, "approved"), edited.content

    body = token_client(agent).get(f"/api/v1/runs/{run.pk}").json()
    assert body["plan"]["steps"][0]["params"] == {"argv": ["echo", "pip", "install", "one"]}
    assert (body["planner"], body["goal"], body["submitted_plan"]) == ("llm", "install the packages", {})
    assert Run.objects.get(pk=run.pk).steps.get().params == {"argv": ["echo", "pip", "install", "one"]}


@pytest.mark.django_db
@pytest.mark.parametrize("comment", ["", "   "])
def test_the_decision_service_itself_refuses_a_rejection_without_a_reason(
        seeded_policy, echo_pip_install_is_high, tenant, agent, people, comment, django_capture_on_commit_callbacks):
    """The rule lives in the one decision service, so every caller (page,
    API, admin, anything added later) gets it."""
    from approvals.services import approval_decide
    from runs.errors import ExecGoError

    approval = waiting_run(tenant, agent, ["echo", "pip", "install", "all"], django_capture_on_commit_callbacks)
    with pytest.raises(ExecGoError) as refused:
        approval_decide(request=approval, actor=people[0], approve=False, digest=approval.action_digest,
                        comment=comment)
    assert refused.value.envelope["code"] == "invalid_input"
    assert refused.value.envelope["details"]["fields"] == {"comment": ["A rejection needs a reason."]}
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "pending" and not Decision.objects.exists()
