"""Helpers of the approvals' interface tests (test_interfaces_*.py): the
error envelope, what a refused call must leave as it was, signed-in clients,
and waiting runs and their requests, made directly or rated by the real
policy."""

from django.test import Client
from django.utils import timezone

from approvals.interface import open_request
from approvals.models import ApprovalRequest, Decision
from policy.interface import evaluate_policy
from runs.models import Job, Run, Step

ENVELOPE_KEYS = {"code", "message", "retryable", "source", "details"}
PACKAGE_INSTALL_REASON = "shell-package-install: installs packages (changes the host, runs third-party install scripts)"


def error_of(response, http_status: int, code: str) -> dict:
    """The error envelope of ``response``, checked for its status and shape."""
    assert response.status_code == http_status, (response.status_code, response.content[:1000])
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == ENVELOPE_KEYS, body
    assert body["error"]["code"] == code, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    assert body["error"]["retryable"] is False, body
    assert "Traceback" not in response.content.decode()
    return body["error"]


def snapshot(approval: ApprovalRequest) -> tuple:
    """What a refused call must leave as it was: the request, its run, the decisions."""
    approval.refresh_from_db()
    run = Run.objects.get(pk=approval.run_id)
    return (approval.status, approval.decided_at, run.state,
            list(Decision.objects.filter(request=approval).values_list("decider_id", "decision", "comment")))


def signed_in(user, cls=Client, **kwargs):
    client = cls(**kwargs)
    client.force_login(user)
    return client


def waiting_run(make_run, **fields) -> Run:
    return make_run("AWAITING_HITL", previous_state="POLICY_CHECK", **fields)


def run_of(tenant, user, state: str = "AWAITING_HITL") -> Run:
    """A run of another tenant than the ``make_run`` factory's."""
    job = Job.objects.create(tenant=tenant, created_by=user)
    run = Run.objects.create(job=job, tenant=tenant, submitted_by=user, state=state, previous_state="POLICY_CHECK",
                             plan={"steps": []}, timeout_s=600, approval_timeout_s=3600,
                             last_state_change_at=timezone.now())
    Job.objects.filter(pk=job.pk).update(latest_run=run)
    return run


def submitted_by(run: Run, user) -> Run:
    Run.objects.filter(pk=run.pk).update(submitted_by=user)
    run.refresh_from_db()
    return run


def add_shell_steps(run: Run, *argvs: list[str]) -> None:
    for position, argv in enumerate(argvs):
        Step.objects.create(run=run, step_id=f"s{position}", position=position, tool="shell",
                            params={"argv": argv}, depends_on=[f"s{position - 1}"] if position else [], timeout_s=5)


def rated_approval(run: Run) -> ApprovalRequest:
    """The request the pipeline opens for ``run``: its steps rated by the real policy."""
    decision = evaluate_policy(run)
    assert decision.risk == "high", decision.data
    return open_request(run, decision.data, now=timezone.now())


def messages_of(response) -> list[str]:
    return [str(message) for message in response.context["messages"]]
