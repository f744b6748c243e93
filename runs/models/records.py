"""What runs leave behind: long-term memory, traces, the audit log and the
event outbox."""

from django.conf import settings
from django.db import models
from django.utils import timezone

from runs.models.run import Run, Step, Tenant
from runs.statemachine import RunState

S = RunState


class MemoryEntry(models.Model):
    """Long-term memory of an agent in a tenant, written only by the TRACING
    stage of a run that ends SUCCEEDED."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memories")
    agent = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memories")
    run = models.OneToOneField(Run, on_delete=models.CASCADE, related_name="memory")
    summary = models.TextField()
    data = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["tenant", "agent", "-id"], name="memory_recall")]

    def __str__(self) -> str:
        return f"memory of run {self.run_id}"


class TraceKind(models.TextChoices):
    TRANSITION = "transition"
    RUN = "run"
    STEP = "step"
    MEMORY_RETRIEVE = "memory_retrieve"
    TOOL_INVOCATION = "tool_invocation"
    POLICY_DECISION = "policy_decision"
    HITL_DECISION = "hitl_decision"


class Trace(models.Model):
    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="traces")
    kind = models.CharField(max_length=20, choices=TraceKind.choices)
    from_state = models.CharField(max_length=20, blank=True)
    to_state = models.CharField(max_length=20, blank=True)
    step = models.ForeignKey(Step, null=True, blank=True, on_delete=models.SET_NULL, related_name="traces")
    data = models.JSONField(default=dict, blank=True)
    error = models.JSONField(null=True, blank=True)
    # When the change it records was made (the row may be written at the end
    # of its transaction: ``runs.recording``), not when it was inserted.
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.kind} trace of run {self.run_id}"


class AuditEvent(models.TextChoices):
    """Every event the audit log records (written by ``runs.audit.audit``)."""

    RUN_CREATED = "run_created"
    STATE_CHANGED = "state_changed"  # a transition into a non-final state
    RUN_SUCCEEDED = "run_succeeded"
    RUN_REJECTED = "run_rejected"
    RUN_FAILED = "run_failed"
    RUN_CANCELLED = "run_cancelled"
    INVALID_TRANSITION = "invalid_transition"
    TRANSITION_LOST = "transition_lost"
    CANCEL_REQUESTED = "cancel_requested"
    CANCEL_REFUSED = "cancel_refused"
    CANCEL_SUPERSEDED = "cancel_superseded"
    APPROVAL_APPROVED = "approval_approved"
    APPROVAL_REJECTED = "approval_rejected"
    APPROVAL_REFUSED = "approval_refused"
    ZOMBIE_DETECTED = "zombie_detected"
    ZOMBIE_RECOVERED = "zombie_recovered"
    STEP_REATTACHED = "step_reattached"
    STALE_RESULT_IGNORED = "stale_result_ignored"
    ARTIFACTS_PURGED = "artifacts_purged"
    APPROVAL_REQUESTED = "approval_requested"
    APPROVAL_VOIDED = "approval_voided"
    HITL_TIMEOUT = "hitl_timeout"  # an approval request expired with no decision
    RESERVATION_RECLAIMED = "reservation_reclaimed"  # its worker process died holding it
    DEADLINE_ENFORCED = "deadline_enforced"  # the deadline scan closed a run its timer did not
    APPROVAL_STALE_VIEW = "approval_stale_view"  # a decision made on a view of a plan that changed since
    WORK_RESENT = "work_resent"  # the sweeper sent a stuck run's work again (its messages were lost)
    ADMIN_CHANGED = "admin_changed"  # a policy rule, user, group or membership changed: before/after in data
    TOKEN_CREATED = "token_created"  # an API token was issued (its key is never recorded)
    TOKEN_REVOKED = "token_revoked"  # an API token was revoked or deleted
    GRANT_CREATED = "grant_created"  # an approver allowed the same action again for some hours
    GRANT_APPLIED = "grant_applied"  # a run's high-risk steps ran on standing grants, without waiting
    GRANT_REVOKED = "grant_revoked"
    DECISION_LINK_USED = "decision_link_used"  # a one-time link decided its request
    APPROVAL_ESCALATED = "approval_escalated"  # a pending request's escalation group was told
    DELEGATION_SET = "delegation_set"  # an approver is away until a time and named a delegate (or came back)
    DECISION_LINK_SIGN_IN = "decision_link_sign_in"  # a link signed its approver in, for its request only
    DECISION_LINK_REFUSED = "decision_link_refused"  # a link opened or posted by the wrong person, used, expired, …


# The one audit event of a run's final transition
# (docs/state-machine.md#reconciliation-invariants).
FINAL_AUDIT_EVENT: dict[str, AuditEvent] = {
    S.SUCCEEDED: AuditEvent.RUN_SUCCEEDED,
    S.CLOSED_REJECTED: AuditEvent.RUN_REJECTED,
    S.CLOSED_FAILED: AuditEvent.RUN_FAILED,
    S.CLOSED_CANCELLED: AuditEvent.RUN_CANCELLED,
}


class AuditLog(models.Model):
    """Append-only record of who did what. Rows about a run must outlive a
    rolled-back transaction, so ``run`` carries no database constraint (an
    ``invalid_transition`` row may be written from a second connection while
    the run's own insert is still uncommitted).

    Tamper-evident: the rows of one tenant (and those of no tenant) form a
    hash chain per ``chain_lane`` (0: rows committed with the caller's
    transaction; 1: rows written independently of it, on the second
    connection). ``chain_seq`` numbers a chain's rows 1, 2, …; ``row_hash``
    is the SHA-256 of the canonical JSON of the row's content and
    ``prev_hash``, the previous row's ``row_hash`` (``runs.audit_hash``).
    ``AuditChainHead`` holds each chain's last link. The database refuses
    UPDATE and DELETE of a row (triggers, migration 0010)."""

    run = models.ForeignKey(
        Run, null=True, blank=True, on_delete=models.DO_NOTHING, db_constraint=False, related_name="audit_entries"
    )
    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.DO_NOTHING, db_constraint=False, related_name="+"
    )
    event = models.CharField(max_length=40, choices=AuditEvent.choices)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.DO_NOTHING, db_constraint=False,
        related_name="+",
    )
    caller = models.CharField(max_length=100, blank=True)
    forced_by = models.CharField(max_length=40, blank=True)
    from_state = models.CharField(max_length=20, blank=True)
    to_state = models.CharField(max_length=20, blank=True)
    data = models.JSONField(default=dict, blank=True)
    # Stamped by the writer before it hashes the row (auto_now_add would
    # stamp it after, at the insert).
    created_at = models.DateTimeField(default=timezone.now)
    # Null only on a row written around runs.audit.audit: verification reports it.
    chain_lane = models.PositiveSmallIntegerField(default=0)
    chain_seq = models.PositiveBigIntegerField(null=True, blank=True)
    prev_hash = models.CharField(max_length=64, blank=True)
    row_hash = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["event", "run"], name="audit_event_run")]
        constraints = [
            # A forked chain (two rows with one predecessor) cannot commit,
            # whatever happened to the head's lock.
            models.UniqueConstraint(fields=["tenant", "chain_lane", "chain_seq"], name="audit_chain_link"),
            models.UniqueConstraint(fields=["chain_lane", "chain_seq"], condition=models.Q(tenant__isnull=True),
                                    name="audit_chain_link_no_tenant"),
        ]

    def __str__(self) -> str:
        return f"{self.event} run={self.run_id}"


class AuditChainHead(models.Model):
    """The last link of one audit chain: a tenant's (``chain`` = the
    tenant's id, 0 for rows of no tenant) in one ``lane``. The audit writer
    locks this row for the rest of its transaction, so two writers of a
    chain never chain onto the same predecessor."""

    chain = models.BigIntegerField()
    lane = models.PositiveSmallIntegerField(default=0)
    seq = models.PositiveBigIntegerField(default=0)
    last_hash = models.CharField(max_length=64, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["chain", "lane"], name="audit_chain_head")]

    def __str__(self) -> str:
        return f"audit chain {self.chain}/{self.lane} at {self.seq}"


class EventType(models.TextChoices):
    TASK_SUBMITTED = "task_submitted"
    TASK_ACCEPTED = "task_accepted"
    TASK_STARTED = "task_started"
    TASK_PROGRESSED = "task_progressed"
    TASK_RETRIED = "task_retried"
    TASK_SUCCEEDED = "task_succeeded"
    TASK_FAILED = "task_failed"
    TASK_CANCELLED = "task_cancelled"
    RUN_STATE_CHANGED = "run_state_changed"
    APPROVAL_CHANGED = "approval_changed"  # the plan a pending approval binds to was edited


class Event(models.Model):
    """The outbox: written in the transaction of the change it describes;
    its monotonically increasing id is the resume cursor of every reader."""

    type = models.CharField(max_length=30, choices=EventType.choices)
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="events")
    task_id = models.CharField(max_length=100, blank=True)
    handle_id = models.CharField(max_length=100, blank=True)
    timestamp = models.DateTimeField()
    message = models.CharField(max_length=500, blank=True)
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["run", "id"], name="event_run_cursor")]

    def __str__(self) -> str:
        return f"{self.type} #{self.pk}"


class Dispatch(models.Model):
    """A task message the broker has not taken yet (``runs.dispatch``).

    Written in the transaction whose work it sends, for work accepted from
    outside (a submitted run, a cancel, a decision), or right after a
    commit whose message the broker refused; deleted once the broker took
    it. The relay (``relay_dispatches``, from beat and at each worker's
    start) sends what is left, so a broker outage delays that work and
    loses none of it."""

    task = models.CharField(max_length=200)
    args = models.JSONField(default=list)
    queue = models.CharField(max_length=200, blank=True)
    eta = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.CharField(max_length=200, blank=True)

    class Meta:
        ordering = ["pk"]
        indexes = [models.Index(fields=["created_at"], name="dispatch_created")]

    def __str__(self) -> str:
        return f"Dispatch {self.pk} ({self.task}{tuple(self.args)})"
