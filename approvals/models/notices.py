"""What approvers are told about requests (docs/approvals.md#notifications):
each approver's channels, every message sent or to be sent, and the
one-time decision link each message about an open request carries."""

from django.conf import settings
from django.db import models

from approvals.models.requests import ApprovalRequest
from runs.models import Tenant


class ChatFormat(models.TextChoices):
    SLACK = "slack", "Slack (incoming webhook)"
    TEAMS = "teams", "Microsoft Teams (incoming webhook)"


class NotificationSettings(models.Model):
    """One approver's channels: e-mail to their address, chat to an
    incoming webhook of theirs (its host on ``EXECGO_CHAT_WEBHOOK_HOSTS``);
    and, while they are away, their delegate."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                                related_name="approval_notifications")
    email = models.BooleanField(default=True, help_text="e-mail to the address of the account")
    chat_url = models.URLField(blank=True, max_length=500, help_text="an incoming-webhook URL")
    chat_format = models.CharField(max_length=10, choices=ChatFormat.choices, default=ChatFormat.SLACK)
    # Away: until then, what this approver would be told goes to their delegate (an approver of the tenant).
    away_until = models.DateTimeField(null=True, blank=True)
    delegate = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                 related_name="+")
    updated_at = models.DateTimeField(auto_now=True)

    def away(self, now) -> bool:
        return self.away_until is not None and self.away_until > now and self.delegate_id is not None

    def __str__(self) -> str:
        return f"notification settings of {self.user_id}"


class NotificationKind(models.TextChoices):
    REQUESTED = "requested"
    REMINDER = "reminder"
    ESCALATION = "escalation"
    DECIDED = "decided"
    EXPIRED = "expired"


class NotificationChannel(models.TextChoices):
    EMAIL = "email"
    CHAT = "chat"


class NotificationStatus(models.TextChoices):
    PENDING = "pending"
    SENT = "sent"
    FAILED = "failed"  # every attempt failed (EXECGO_NOTIFY_MAX_ATTEMPTS)


class DecisionLink(models.Model):
    """A one-time decision link: bound to one approver, one request and the
    action digest the message described. Its URL carries a signed token
    (``approvals.notify``); only the digest of the token's secret part is
    kept. Opening it decides nothing; one POST by its approver decides."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    request = models.ForeignKey(ApprovalRequest, on_delete=models.CASCADE, related_name="links")
    recipient = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    digest = models.CharField(max_length=64, help_text="the request's action digest the link was made for")
    secret_sha256 = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)
    used_for = models.CharField(max_length=10, blank=True)  # approve | reject

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"decision link {self.pk} of {self.recipient_id} for request {self.request_id}"


class Notification(models.Model):
    """One message to one approver on one channel, written in the
    transaction of what it reports and sent after it commits, retried with
    backoff; its outcome is kept and shown."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    request = models.ForeignKey(ApprovalRequest, on_delete=models.CASCADE, related_name="notifications")
    recipient = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    kind = models.CharField(max_length=12, choices=NotificationKind.choices)
    channel = models.CharField(max_length=8, choices=NotificationChannel.choices)
    address = models.CharField(max_length=500, help_text="the e-mail address or chat URL at the time it was made")
    subject = models.CharField(max_length=300)
    body = models.TextField()
    link = models.ForeignKey(DecisionLink, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    status = models.CharField(max_length=8, choices=NotificationStatus.choices, default=NotificationStatus.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["status", "created_at"], name="notification_pending")]

    def __str__(self) -> str:
        return f"{self.kind} {self.channel} notification {self.pk} to {self.recipient_id}"
