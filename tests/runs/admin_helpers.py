"""Helpers of the Django admin's tests (tests/runs/test_admin_*.py): the
admin's URLs, the rows a changelist shows, and runs made directly, with one
row of each model that hangs off a run."""

from django.contrib.auth.models import User
from django.urls import reverse
from django.utils import timezone

from policy.models import PolicyRule, PolicyVersion
from runs.models import (
    AuditLog,
    Event,
    EventType,
    Job,
    Membership,
    MemoryEntry,
    Run,
    Step,
    Tenant,
    Trace,
    TraceKind,
    WebhookDelivery,
)
from runs.tokens import token_create

# The models of one_of_each that are not the runs app's.
APP_OF = {"policyrule": "policy", "policyversion": "policy"}


def changelist(model_name: str) -> str:
    return reverse(f"admin:{APP_OF.get(model_name, 'runs')}_{model_name}_changelist")


def change_url(obj) -> str:
    return reverse(f"admin:{obj._meta.app_label}_{obj._meta.model_name}_change", args=[obj.pk])


def result_pks(response) -> list[int]:
    assert response.status_code == 200, response.content[-2000:]
    return sorted(obj.pk for obj in response.context["cl"].result_list)


def add_run(tenant: Tenant, user: User, state: str = "CREATED", *, title: str = "", **fields) -> Run:
    """A run with one step, one trace, one audit row and one event, placed
    directly in ``state`` (test data, not a transition)."""
    job = Job.objects.create(tenant=tenant, created_by=user, title=title)
    run = Run.objects.create(
        job=job, tenant=tenant, submitted_by=user, title=title, state=state, plan={"steps": []}, timeout_s=600,
        approval_timeout_s=3600, last_state_change_at=timezone.now(), **fields,
    )
    Job.objects.filter(pk=job.pk).update(latest_run=run)
    step = Step.objects.create(run=run, step_id=f"step-{run.pk}", position=0, tool="shell",
                               params={"argv": ["true"]}, timeout_s=5)
    Trace.objects.create(run=run, kind=TraceKind.TRANSITION, from_state="CREATED", to_state="PREPARING",
                         step=step)
    AuditLog.objects.create(run=run, tenant=tenant, event="run_created", actor=user, caller="api",
                            to_state="CREATED")
    Event.objects.create(type=EventType.TASK_SUBMITTED, run=run, task_id=step.step_id, timestamp=timezone.now(),
                         message="shell step submitted")
    return run


def one_of_each(run: Run) -> dict:
    return {
        "tenant": run.tenant,
        "membership": Membership.objects.get(user=run.submitted_by),
        "job": run.job,
        "run": run,
        "step": run.steps.get(),
        "trace": run.traces.get(),
        "auditlog": run.audit_entries.get(),
        "event": run.events.get(),
        "memoryentry": MemoryEntry.objects.create(tenant=run.tenant, agent=run.submitted_by, run=run,
                                                  summary="nightly backup: 1 step(s) succeeded"),
        "policyrule": PolicyRule.objects.create(name="no-sudo", tool="shell", field="command", pattern=r"\bsudo\b",
                                                outcome="deny", reason="privilege escalation"),
        "policyversion": PolicyVersion.objects.get_or_create(pk=1)[0],
        "webhookdelivery": WebhookDelivery.objects.create(event="approval.requested", url="https://hooks.example/x",
                                                          payload={"request": 1}, run=run, tenant_id=run.tenant_id),
        "apitoken": token_create(user=run.submitted_by, name="ci")[0],
    }
