"""The kernel's tables: runs and their steps (``run``), what runs leave
behind (``records``), the outgoing webhooks (``webhooks``) and API tokens
(``tokens``). The policy's tables are the policy app's (``policy.models``)."""

from runs.models.records import (
    FINAL_AUDIT_EVENT,
    AuditChainHead,
    AuditEvent,
    AuditLog,
    Dispatch,
    Event,
    EventType,
    MemoryEntry,
    Trace,
    TraceKind,
)
from runs.models.run import CALLBACK_EVENTS, Job, JobStatus, Membership, Run, Step, StepRunStatus, StepStatus, Tenant
from runs.models.tokens import ApiToken
from runs.models.webhooks import WebhookDelivery, WebhookStatus

__all__ = [
    "CALLBACK_EVENTS", "ApiToken",
    "FINAL_AUDIT_EVENT", "AuditChainHead", "AuditEvent", "AuditLog", "Dispatch", "Event", "EventType", "Job", "JobStatus", "Membership",
    "MemoryEntry", "Run", "Step", "StepRunStatus", "StepStatus",
    "Tenant", "Trace", "TraceKind", "WebhookDelivery", "WebhookStatus",
]
