"""Tenants, the Job projection, runs and their steps.

Run lifecycle (the full table is data in ``runs.statemachine``)::

    CREATED → PREPARING → PLANNING → POLICY_CHECK → [AWAITING_HITL] → EXECUTING
                    any failure ↘ FAILED | TIMEOUT | REJECTED | CANCELLED
    EXECUTING (success) and every transient state → TRACING → one final state

``Run.state`` is written only by ``runs.transitions.run_transition``; a
step's ``status`` and ``run_status`` (its lifecycle: ``runs.step_lifecycle``)
only by ``runs.step_lifecycle.step_set``.
"""

import secrets
from datetime import datetime, timedelta

from django.conf import settings
from django.db import models
from django.db.models import Q
from django_fsm import ConcurrentTransitionMixin, FSMField, transition

from runs.statemachine import FINAL, FINAL_STATE_FOR_CAUSE, ClosingCause, RunState, sources_into
from runs.step_lifecycle import INITIAL, STATUS_FIELDS, StepRunStatus, StepStatus, refuse_direct_write

S = RunState


def new_webhook_secret() -> str:
    return secrets.token_urlsafe(32)


def default_reminder_fractions() -> list[float]:
    return [0.5, 0.9]


class Tenant(models.Model):
    name = models.CharField(max_length=200, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # The HMAC key of this tenant's webhooks (runs.webhooks); shown to its
    # staff and rotated in the admin, never in a form, a list or a log.
    webhook_secret = models.CharField(max_length=64, default=new_webhook_secret, editable=False)
    # The longest an approver may allow an action again without asking
    # (approvals' standing grants); 0: no standing grants in this tenant.
    standing_grant_max_hours = models.PositiveSmallIntegerField(
        default=8, help_text="the longest standing grant an approver of this tenant may give, in hours (0: none)")
    # Approval reminders and escalation (approvals.reminders).
    approval_reminder_fractions = models.JSONField(
        default=default_reminder_fractions, blank=True,
        help_text="when approvers are reminded of a pending request: fractions of its time, e.g. [0.5, 0.9]")
    approval_escalation_after_s = models.PositiveIntegerField(
        default=0, help_text="seconds after a request opened that its escalation group is told (0: never)")
    approval_escalation_group = models.CharField(
        max_length=150, default="escalation", help_text="the group told of an escalated request, who may decide it")

    def __str__(self) -> str:
        return self.name


class Membership(models.Model):
    """Puts a user in exactly one tenant."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="membership")
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="memberships")

    def __str__(self) -> str:
        return f"{self.user} @ {self.tenant}"


class JobStatus(models.TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class Job(models.Model):
    """The legacy unit of work. ``status`` is a read-only projection of its
    latest run's state (docs/state-machine.md#job-status-projection); the
    kernel never reads it to decide."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="jobs")
    title = models.CharField(max_length=200, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    status = models.CharField(max_length=16, choices=JobStatus.choices, default=JobStatus.PENDING)
    run_state_snapshot = models.JSONField(default=dict, blank=True)
    latest_run = models.ForeignKey("Run", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"Job {self.pk} ({self.status})"


def _closes_into(target: RunState):
    """A django-fsm condition: TRACING may only close into the final state its
    closing cause names."""

    def condition(run: "Run") -> bool:
        return FINAL_STATE_FOR_CAUSE.get(run.closing_cause) == target

    condition.__name__ = f"closing_cause_leads_to_{target.value.lower()}"
    return condition


CALLBACK_EVENTS = ("final", "awaiting_human")


class Run(ConcurrentTransitionMixin, models.Model):
    # The plan and the assembled context are the bulk of a row: the state
    # machine's reads leave them out, and the stage that needs one loads it.
    BULKY_FIELDS = ("plan", "submitted_plan", "context")

    job = models.ForeignKey(Job, on_delete=models.PROTECT, related_name="runs")
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="runs")
    submitted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="submitted_runs"
    )
    title = models.CharField(max_length=200, blank=True)
    state = FSMField(default=S.CREATED, choices=S.choices, protected=True, max_length=20)
    # The state before the current one; tells where a TIMEOUT came from.
    previous_state = models.CharField(max_length=20, choices=S.choices, blank=True)
    closing_cause = models.CharField(max_length=20, choices=ClosingCause.choices, blank=True)
    retry_of = models.ForeignKey("self", null=True, blank=True, on_delete=models.PROTECT, related_name="retries")
    planner = models.CharField(max_length=20, default="static")
    goal = models.TextField(blank=True)  # what the llm planner turns into a plan
    # What will run: the agent's plan, the llm planner's, or either as an approver edited it.
    plan = models.JSONField(default=dict, blank=True)
    # The plan as the agent submitted it, kept beside ``plan`` (empty for the llm planner: the goal is what it sent).
    submitted_plan = models.JSONField(default=dict, blank=True)
    timeout_s = models.PositiveIntegerField()
    approval_timeout_s = models.PositiveIntegerField()
    idempotency_key = models.CharField(max_length=200, null=True, blank=True)
    # A digest of the request an Idempotency-Key was first used with: the
    # same key with another body is a conflict, not a replay.
    idempotency_fingerprint = models.CharField(max_length=64, blank=True)
    # Where ExecGo POSTs the run's summary (signed, see runs/webhooks.py), and on which events.
    callback_url = models.CharField(max_length=2000, blank=True)
    callback_events = models.JSONField(default=list, blank=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Persisted before AWAITING_HITL so execution resumes from it after approval.
    context = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_state_change_at = models.DateTimeField()
    executing_started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # When the retention GC removed the run's workspaces and logs (rows stay).
    artifacts_purged_at = models.DateTimeField(null=True, blank=True)
    # How often, and last when, the sweeper sent the run's work again (a
    # broker that lost its messages, runs.sweeper): it fails a run with no
    # progress only once these run out.
    resends = models.PositiveSmallIntegerField(default=0)
    resent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "idempotency_key"],
                condition=Q(idempotency_key__isnull=False),
                name="run_idempotency_key_per_tenant",
            ),
        ]
        indexes = [
            # The zombie sweeper's scan: non-final runs by how long they have
            # been in their state. Final runs (the vast majority) stay out.
            models.Index(
                fields=["state", "last_state_change_at"],
                condition=~Q(state__in=sorted(FINAL)),  # sorted: a stable migration
                name="run_nonfinal_state_age",
            ),
            models.Index(fields=["tenant", "-id"], name="run_tenant_newest"),
            # The deadline scan (runs.deadlines.scan_deadlines): EXECUTING runs
            # by when they started executing; no other state is in it.
            models.Index(
                fields=["executing_started_at"],
                condition=Q(state=S.EXECUTING),
                name="run_executing_since",
            ),
        ]

    def __str__(self) -> str:
        return f"Run {self.pk} ({self.state})"

    @property
    def is_final(self) -> bool:
        return self.state in FINAL

    @property
    def deadline(self) -> datetime | None:
        """When EXECUTING runs out of time: the run's total time (docs/stages.md#executing)."""
        if self.executing_started_at is None:
            return None
        return self.executing_started_at + timedelta(seconds=self.timeout_s)

    # --- transitions: sources come from runs.statemachine.TRANSITIONS -------
    # Bodies are empty on purpose: the transition service stamps fields,
    # writes traces, events and the projection in the same transaction.

    @transition(field=state, source=sources_into(S.PREPARING), target=S.PREPARING)
    def to_preparing(self) -> None: ...

    @transition(field=state, source=sources_into(S.PLANNING), target=S.PLANNING)
    def to_planning(self) -> None: ...

    @transition(field=state, source=sources_into(S.POLICY_CHECK), target=S.POLICY_CHECK)
    def to_policy_check(self) -> None: ...

    @transition(field=state, source=sources_into(S.AWAITING_HITL), target=S.AWAITING_HITL)
    def to_awaiting_hitl(self) -> None: ...

    @transition(field=state, source=sources_into(S.EXECUTING), target=S.EXECUTING)
    def to_executing(self) -> None: ...

    @transition(field=state, source=sources_into(S.TRACING), target=S.TRACING)
    def to_tracing(self) -> None: ...

    @transition(field=state, source=sources_into(S.REJECTED), target=S.REJECTED)
    def to_rejected(self) -> None: ...

    @transition(field=state, source=sources_into(S.FAILED), target=S.FAILED)
    def to_failed(self) -> None: ...

    @transition(field=state, source=sources_into(S.FAILED, include_sweeper_only=True), target=S.FAILED)
    def force_failed(self) -> None:
        """FAILED including the sweeper-only edges (CREATED, POLICY_CHECK, TRACING)."""

    @transition(field=state, source=sources_into(S.TIMEOUT), target=S.TIMEOUT)
    def to_timeout(self) -> None: ...

    @transition(field=state, source=sources_into(S.CANCELLED), target=S.CANCELLED)
    def to_cancelled(self) -> None: ...

    @transition(
        field=state, source=sources_into(S.SUCCEEDED), target=S.SUCCEEDED, conditions=[_closes_into(S.SUCCEEDED)]
    )
    def to_succeeded(self) -> None: ...

    @transition(
        field=state,
        source=sources_into(S.CLOSED_REJECTED),
        target=S.CLOSED_REJECTED,
        conditions=[_closes_into(S.CLOSED_REJECTED)],
    )
    def to_closed_rejected(self) -> None: ...

    @transition(
        field=state,
        source=sources_into(S.CLOSED_FAILED),
        target=S.CLOSED_FAILED,
        conditions=[_closes_into(S.CLOSED_FAILED)],
    )
    def to_closed_failed(self) -> None: ...

    @transition(
        field=state,
        source=sources_into(S.CLOSED_CANCELLED),
        target=S.CLOSED_CANCELLED,
        conditions=[_closes_into(S.CLOSED_CANCELLED)],
    )
    def to_closed_cancelled(self) -> None: ...


class StepQuerySet(models.QuerySet):
    def update(self, **fields):
        refuse_direct_write(fields)
        return super().update(**fields)


class Step(models.Model):
    """One step of a run's plan. Its two status layers are written by
    ``runs.step_lifecycle.step_set`` only: a save, a QuerySet update or a
    compiled UPDATE (``runtime.statements``) writing them otherwise raises."""

    WRITER_ONLY_FIELDS = STATUS_FIELDS

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="steps")
    step_id = models.CharField(max_length=100)
    position = models.PositiveIntegerField()
    tool = models.CharField(max_length=50)
    params = models.JSONField(default=dict)
    depends_on = models.JSONField(default=list)
    timeout_s = models.FloatField()
    retries = models.PositiveSmallIntegerField(default=0)
    status = models.CharField(max_length=10, choices=StepStatus.choices, default=StepStatus.PENDING)
    run_status = models.CharField(max_length=10, choices=StepRunStatus.choices, blank=True)
    handle_id = models.CharField(max_length=100, blank=True)
    # The fencing epoch: a result is applied only while ``attempt`` still
    # names the execution that produced it.
    attempt = models.PositiveSmallIntegerField(default=0)
    host = models.CharField(max_length=200, blank=True)
    progress = models.PositiveSmallIntegerField(null=True, blank=True)
    requested_plan = models.JSONField(default=dict, blank=True)
    # The effective plan POLICY_CHECK rated (and a human may have approved):
    # no host runs the step weaker (runs.dataplane.weaker_than_rated).
    rated_plan = models.JSONField(default=dict, blank=True)
    effective_plan = models.JSONField(default=dict, blank=True)
    result = models.JSONField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = StepQuerySet.as_manager()

    class Meta:
        ordering = ["run_id", "position"]
        constraints = [models.UniqueConstraint(fields=["run", "step_id"], name="step_id_unique_per_run")]

    def __str__(self) -> str:
        return f"Step {self.step_id} of run {self.run_id} ({self.status})"

    refuse_direct_write = staticmethod(refuse_direct_write)

    def save(self, *args, **kwargs):
        """A step is created pending with no attempt; its status layers
        change through ``step_set`` only. (The row is read back to compare
        only here, where the application never saves a step, so that the
        steps settle reads carry nothing extra.)"""
        fields = kwargs.get("update_fields")
        written = [name for name in STATUS_FIELDS if name in self.__dict__ and (fields is None or name in fields)]
        if written:
            if self._state.adding:
                before = dict(zip(STATUS_FIELDS, INITIAL))
            else:
                before = type(self).objects.filter(pk=self.pk).values(*STATUS_FIELDS).first() or {}
            refuse_direct_write(written, changed=any(before.get(name) != getattr(self, name) for name in written))
        super().save(*args, **kwargs)
