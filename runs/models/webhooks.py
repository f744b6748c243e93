"""Outgoing webhooks: one row per notification, written in the transaction of
the change it reports (the outbox pattern) and delivered afterwards by the
``runs.tasks.deliver_webhook`` task (``runs.webhooks``)."""

from django.db import models

from runs.models.run import Run, Tenant


class WebhookStatus(models.TextChoices):
    PENDING = "pending"
    DELIVERED = "delivered"  # a 2xx answer; never sent again
    FAILED = "failed"  # gave up after EXECGO_WEBHOOK_MAX_ATTEMPTS; never sent again


class WebhookDelivery(models.Model):
    event = models.CharField(max_length=64)  # e.g. "approval.requested", "approval.decided"
    url = models.CharField(max_length=2000)  # http(s); checked by runs.webhooks before sending
    payload = models.JSONField(default=dict)
    status = models.CharField(max_length=10, choices=WebhookStatus.choices, default=WebhookStatus.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    last_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    # What the notification is about, when it is about a run (kept if the run goes).
    run = models.ForeignKey(Run, null=True, blank=True, on_delete=models.SET_NULL, related_name="webhook_deliveries")
    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

    class Meta:
        ordering = ["-id"]
        verbose_name_plural = "webhook deliveries"
        indexes = [
            # Pending deliveries, oldest first (a re-sender's scan), and the admin's status filter.
            models.Index(fields=["status", "created_at"], name="webhook_status_created"),
        ]

    def __str__(self) -> str:
        return f"{self.event} delivery {self.pk} ({self.status})"
