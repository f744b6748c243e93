"""Approval requests: one per entry of a run into AWAITING_HITL, bound to the
exact action it covers, and the decisions of the people who answered it.
A request's statuses and their moves are ``approvals.lifecycle``'s.

A request is written with the run's move into AWAITING_HITL (same
transaction, ``approvals.interface.open_request``), so a run waiting for a
human always has exactly one pending request.
"""

import hashlib
import json
import re
import unicodedata

from django.conf import settings
from django.db import models
from django.db.models import Max, Q

from approvals.lifecycle import ApprovalStatus, InvalidApprovalTransition, writing_status
from policy.models import PolicyRule
from runs.models import Run, Step, Tenant
from runs.webhooks import webhook_configured, webhook_notify

APPROVERS_GROUP = "approvers"
AGENTS_GROUP = "agents"


# Header names whose values an approver sees as a length only.
SECRET_HEADER = re.compile(r"(?i)authorization|cookie|token|secret|passw|api[-_]?key|session|signature|credential")


def _digest_of(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
                          .encode()).hexdigest()


def normalised_action(step: Step) -> dict:
    """What a step will do, as an approver must see it and as the action
    digest binds it: the exact arguments, with bodies and file contents
    reduced to their digest (and shown in full on the page), and the
    effective plan the policy rated it on."""
    params = step.params or {}
    action: dict = {"id": step.step_id, "tool": step.tool, "depends_on": list(step.depends_on or []),
                    "sandbox": step.requested_plan or {}, "timeout_s": step.timeout_s, "retries": step.retries}
    if step.rated_plan:  # the plan it was rated on, which no host may weaken (runs.dataplane.queue_for)
        action["rated_plan"] = step.rated_plan
    if step.tool == "shell":
        action.update({key: params[key] for key in ("argv", "script", "cwd") if key in params})
        action["env"] = params.get("env") or {}
        if "stdin" in params:
            action["stdin_sha256"] = hashlib.sha256(str(params["stdin"]).encode()).hexdigest()
    elif step.tool == "http":
        # A secret-looking header's value is bound by its digest: the request is read by every approver.
        action.update({"method": str(params.get("method", "GET")).upper(), "url": params.get("url"),
                       "headers": {name: "sha256:" + hashlib.sha256(str(value).encode()).hexdigest()
                                   if SECRET_HEADER.search(str(name)) else value
                                   for name, value in (params.get("headers") or {}).items()}})
        if "body" in params:
            action["body_sha256"] = _digest_of(params["body"])
    else:
        action.update({key: params[key] for key in ("op", "path") if key in params})
        if "content" in params:
            action["content_sha256"] = hashlib.sha256(str(params["content"]).encode()).hexdigest()
    return action


# Characters that change how text looks without being seen: escaped wherever
# an approver reads a step (the C0/C1 controls but tab and newline, the
# bidirectional controls, zero-width characters, the BOM).
INVISIBLE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def visible_text(value) -> str:
    """``value`` as text with every invisible character written as its
    escape (``\x1b``, ``\u202e``), so what an approver reads is what the
    bytes say."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)
    return INVISIBLE.sub(lambda match: (f"\\x{ord(match[0]):02x}" if ord(match[0]) < 0x100
                                        else f"\\u{ord(match[0]):04x}"), text)


def _shown_text(value) -> dict:
    """A text an approver must read in full: its visible form, its size, and
    whether it is over ``EXECGO_APPROVAL_SHOW_MAX_BYTES`` (then only its head
    is shown, and ``policy.evaluation`` rates the step at least high: "too large to
    review")."""
    raw = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True, indent=2)
    size = len(raw.encode())
    cap = settings.EXECGO_APPROVAL_SHOW_MAX_BYTES
    shown = raw if size <= cap else raw.encode()[:cap].decode(errors="ignore")
    return {"text": visible_text(shown), "bytes": size, "lines": raw.count("\n") + 1, "too_large": size > cap,
            "escaped": bool(INVISIBLE.search(raw)) or any(unicodedata.category(char) == "Cf" for char in raw)}


def shown_action(step: Step) -> dict:
    """Every byte of ``step`` that can change what runs, as an approver reads
    it: argv as a list, the texts in full (``_shown_text``), secret-looking
    header values as their length only, the sandbox and the limits."""
    params = step.params if isinstance(step.params, dict) else {}
    shown: dict = {"sandbox": step.requested_plan or {}, "timeout_s": step.timeout_s, "retries": step.retries,
                   "rated_plan": step.rated_plan or None}
    if step.tool == "shell":
        if isinstance(params.get("argv"), list):
            shown["argv"] = [visible_text(str(arg)) for arg in params["argv"]]
        for key in ("script", "stdin"):
            if key in params:
                shown[key] = _shown_text(params[key])
        shown["cwd"] = visible_text(params["cwd"]) if "cwd" in params else None
        shown["env"] = {visible_text(str(name)): visible_text(str(value))
                        for name, value in sorted((params.get("env") or {}).items())}
    elif step.tool == "http":
        shown["method"] = visible_text(str(params.get("method", "GET")).upper())
        shown["url"] = visible_text(str(params.get("url", "")))
        shown["headers"] = [
            {"name": visible_text(str(name)), "length": len(str(value)), "masked": True}
            if SECRET_HEADER.search(str(name)) else {"name": visible_text(str(name)), "value": visible_text(str(value))}
            for name, value in sorted((params.get("headers") or {}).items())]
        if "body" in params:
            shown["body"] = _shown_text(params["body"])
    else:
        shown.update({key: visible_text(str(params[key])) for key in ("op", "path") if key in params})
        if "content" in params:
            shown["content"] = _shown_text(params["content"])
    return shown


def action_digest(steps: list[Step], policy_version: int) -> str:
    """The digest an approval is bound to: every step of the run (the whole
    plan runs once approved) and the policy version that rated it."""
    return _digest_of({"steps": [normalised_action(step) for step in steps], "policy_version": policy_version})


class ApprovalRequestQuerySet(models.QuerySet):
    def update(self, **fields):
        if "status" in fields and not writing_status():
            raise InvalidApprovalTransition("a request's status is written by approvals.lifecycle.request_finish only")
        return super().update(**fields)


class ApprovalRequest(models.Model):
    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="approval_requests")
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="approval_requests")
    status = models.CharField(max_length=10, choices=ApprovalStatus.choices, default=ApprovalStatus.PENDING)
    # Every step with its normalised action, risk and the reasons of each
    # rule that matched it; the high ones are what needs the approval.
    steps = models.JSONField(default=list)
    risk = models.CharField(max_length=10)
    policy_version = models.PositiveIntegerField()
    action_digest = models.CharField(max_length=64)
    approvals_required = models.PositiveSmallIntegerField(default=1)
    requested_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    decided_at = models.DateTimeField(null=True, blank=True)
    # Approve with edits: the plan as submitted, and who narrowed it.
    original_steps = models.JSONField(null=True, blank=True)
    # The plan as proposed, then after each edit (``plan_version``), oldest first.
    versions = models.JSONField(default=list, blank=True)
    edited_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                  related_name="+")
    # Reminders sent so far, and when the escalation group was told (approvals.reminders).
    reminders_sent = models.PositiveSmallIntegerField(default=0)
    escalated_at = models.DateTimeField(null=True, blank=True)
    # From the rule that rated it high, when that rule says (else the tenant's, read at each scan).
    reminder_fractions = models.JSONField(null=True, blank=True)
    escalation_after_s = models.PositiveIntegerField(null=True, blank=True)

    objects = ApprovalRequestQuerySet.as_manager()

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(fields=["run"], condition=Q(status="pending"), name="one_pending_request_per_run"),
        ]
        indexes = [
            # The inbox: a tenant's requests by status, newest first.
            models.Index(fields=["tenant", "status", "-id"], name="approval_inbox"),
            # The expiry fallback's scan: pending requests by when they expire.
            models.Index(fields=["expires_at"], condition=Q(status="pending"), name="approval_pending_expiry"),
        ]

    def __str__(self) -> str:
        return f"approval request {self.pk} for run {self.run_id} ({self.status})"

    @classmethod
    def from_db(cls, db, field_names, values):
        request = super().from_db(db, field_names, values)
        request._stored_status = request.__dict__.get("status")
        return request

    def save(self, *args, **kwargs):
        """A request is created pending; its status changes through
        ``approvals.lifecycle.request_finish`` only."""
        before = ApprovalStatus.PENDING if self._state.adding else getattr(self, "_stored_status", None)
        changed = "status" in self.__dict__ and before is not None and self.status != before
        if changed and not writing_status():
            raise InvalidApprovalTransition("a request's status is written by approvals.lifecycle.request_finish only")
        super().save(*args, **kwargs)
        self._stored_status = self.__dict__.get("status")

    @property
    def high_risk_steps(self) -> list[dict]:
        return [step for step in self.steps if step.get("risk") in ("high", "deny")]

    @property
    def approvals_so_far(self) -> int:
        return sum(1 for decision in self.decisions.all() if decision.decision == DecisionKind.APPROVE)

    def notify_requested(self) -> None:
        """The ``approval.requested`` webhook, in the caller's transaction."""
        if not webhook_configured(settings.EXECGO_APPROVAL_WEBHOOK_URL):
            return
        webhook_notify("approval.requested", {
            "request": self.pk, "run": self.run_id, "tenant": self.tenant_id, "risk": self.risk,
            "action_digest": self.action_digest, "approvals_required": self.approvals_required,
            "expires_at": self.expires_at.isoformat(), "actions": [step["action"] for step in self.steps],
            "url": f"/approvals/{self.pk}/",
        }, url=settings.EXECGO_APPROVAL_WEBHOOK_URL, run_id=self.run_id, tenant_id=self.tenant_id)

    def notify_decided(self, *, decided_by=None, comment: str = "", reason: str = "") -> None:
        """The ``approval.decided`` webhook of this request, now in a final
        status: a delivery row in the caller's transaction, sent after it commits."""
        if not webhook_configured(settings.EXECGO_APPROVAL_WEBHOOK_URL):
            return
        webhook_notify("approval.decided", {
            "request": self.pk, "run": self.run_id, "tenant": self.tenant_id, "status": str(self.status),
            "decided_by": decided_by.get_username() if decided_by is not None else None, "comment": comment,
            "reason": reason or None, "decided_at": self.decided_at.isoformat() if self.decided_at else None,
            "url": f"/approvals/{self.pk}/",
        }, url=settings.EXECGO_APPROVAL_WEBHOOK_URL, run_id=self.run_id, tenant_id=self.tenant_id)


def reminders_of(decision: dict) -> tuple[list | None, int | None]:
    """The reminder fractions and escalation delay a rated plan's request
    takes: each from the first rule (in priority order) that rated a step
    high and sets it; None: the tenant's."""
    high = [rule["id"] for rule in decision["matched_rules"] if rule["outcome"] == "high"]
    rules = {rule.pk: rule for rule in PolicyRule.objects.filter(pk__in=high)}
    fractions = next((rules[pk].reminder_fractions for pk in high
                      if pk in rules and rules[pk].reminder_fractions is not None), None)
    delay = next((rules[pk].escalation_after_s for pk in high
                  if pk in rules and rules[pk].escalation_after_s is not None), None)
    return fractions, delay


def quorum_of(decision: dict) -> int:
    """How many distinct approvers a rated plan needs: the most any rule that
    rated one of its steps high asks for (at least one)."""
    high_rules = [rule["id"] for rule in decision["matched_rules"] if rule["outcome"] == "high"]
    return PolicyRule.objects.filter(pk__in=high_rules).aggregate(n=Max("approvals_required"))["n"] or 1


def rated_steps(steps: list[Step], decision: dict) -> list[dict]:
    """A request's ``steps``: each step's normalised action (what the digest
    binds), what an approver reads of it, its risk and reasons."""
    rated = {row["id"]: row for row in decision["steps"]}
    return [{"action": normalised_action(step), "shown": shown_action(step),
             "risk": rated.get(step.step_id, {}).get("risk", "low"),
             "reasons": rated.get(step.step_id, {}).get("reasons", [])} for step in steps]


def plan_version(kind: str, digest: str, steps: list[dict], *, risk: str, approvals_required: int, at,
                 by=None) -> dict:
    """One entry of a request's ``versions``: the plan as proposed, or as an
    approver edited it."""
    return {"kind": kind, "digest": digest, "risk": risk, "approvals_required": approvals_required,
            "by": by.get_username() if by is not None else None, "at": at.isoformat(), "steps": steps}


class DecisionKind(models.TextChoices):
    APPROVE = "approve"
    REJECT = "reject"


class Decision(models.Model):
    """One person's answer to a request; a person answers a request once."""

    request = models.ForeignKey(ApprovalRequest, on_delete=models.PROTECT, related_name="decisions")
    decider = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    decision = models.CharField(max_length=10, choices=DecisionKind.choices)
    comment = models.TextField(blank=True)
    decided_at = models.DateTimeField(auto_now_add=True)
    # The steps as this approver narrowed them (approve with edits).
    edits = models.JSONField(null=True, blank=True)
    # The action digest of the plan this decision was made on (after its own edits, if any).
    digest = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["id"]
        constraints = [models.UniqueConstraint(fields=["request", "decider"], name="one_decision_per_person")]

    def __str__(self) -> str:
        return f"{self.decision} by {self.decider_id} on request {self.request_id}"


def grant_digest(step: Step) -> str:
    """What a standing grant is bound to: one step's normalised action but
    its place in a plan (its id and what it depends on) — the same tool, the
    exact arguments, texts, headers and bodies, the same sandbox and rated
    plan, the same limits."""
    action = normalised_action(step)
    action.pop("id")
    action.pop("depends_on")
    return _digest_of(action)


class StandingGrantQuerySet(models.QuerySet):
    def live(self, now):
        return self.filter(revoked_at__isnull=True, expires_at__gt=now)


class StandingGrant(models.Model):
    """"Approve, and allow this same action for this agent for N hours"
    (docs/approvals.md#standing-grants): a later run of ``agent`` whose
    high-risk step has this ``digest`` (``grant_digest``) does not wait for
    a person for that step while the grant is live."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="standing_grants")
    agent = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    digest = models.CharField(max_length=64)
    action = models.JSONField(help_text="the normalised action, as the approver read it")
    request = models.ForeignKey(ApprovalRequest, on_delete=models.PROTECT, related_name="grants")
    granted_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    granted_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)
    revoked_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
                                   related_name="+")
    uses = models.PositiveIntegerField(default=0)
    last_used_at = models.DateTimeField(null=True, blank=True)

    objects = StandingGrantQuerySet.as_manager()

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["tenant", "agent", "digest"], name="standing_grant_lookup")]

    def __str__(self) -> str:
        return f"standing grant {self.pk} to {self.agent_id} until {self.expires_at:%Y-%m-%d %H:%M}"

    def live_at(self, now) -> bool:
        return self.revoked_at is None and self.expires_at > now
