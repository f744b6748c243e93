"""The per-host resource ledger.

A step reserves task slots, memory and pids on its host before its shim is
launched and releases them on every terminal path. Counters change only in
``runtime.ledger``, by compare-and-swap UPDATEs; the CHECK constraints make
a negative or over-capacity counter impossible even for a buggy caller.
"""

from django.db import models
from django.db.models import F, Q
from django.utils import timezone


class HostCapacity(models.Model):
    host = models.CharField(max_length=255, primary_key=True)
    task_slots_capacity = models.BigIntegerField()
    task_slots_reserved = models.BigIntegerField(default=0)
    memory_bytes_capacity = models.BigIntegerField()
    memory_bytes_reserved = models.BigIntegerField(default=0)
    pids_capacity = models.BigIntegerField()
    pids_reserved = models.BigIntegerField(default=0)
    capabilities = models.JSONField(default=dict, blank=True)
    last_seen = models.DateTimeField(default=timezone.now)

    class Meta:
        verbose_name_plural = "host capacities"
        constraints = [
            models.CheckConstraint(
                condition=Q(**{f"{name}_reserved__gte": 0}) & Q(**{f"{name}_reserved__lte": F(f"{name}_capacity")}),
                name=f"runtime_host_{name}_within_capacity",
            )
            for name in ("task_slots", "memory_bytes", "pids")
        ]

    def __str__(self) -> str:
        return (
            f"{self.host}: {self.task_slots_reserved}/{self.task_slots_capacity} slots, "
            f"{self.pids_reserved}/{self.pids_capacity} pids"
        )


class Reservation(models.Model):
    host = models.ForeignKey(HostCapacity, on_delete=models.PROTECT, related_name="reservations")
    handle_id = models.CharField(max_length=128, unique=True)
    task_slots = models.BigIntegerField(default=1)
    memory_bytes = models.BigIntegerField(default=0)
    pids = models.BigIntegerField(default=0)
    reserved_at = models.DateTimeField(default=timezone.now)
    waited_ms = models.BigIntegerField(default=0)
    # The process holding the reservation (on ``host``): its pid and its
    # start time, so a reused pid is not mistaken for the owner. A row
    # whose owner is gone is reclaimed (``ledger.reclaim``); null: an owner
    # that did not say (reclaimed only by ``recover`` at worker start).
    owner_pid = models.PositiveIntegerField(null=True, blank=True)
    owner_started_at = models.FloatField(null=True, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(task_slots__gte=0) & Q(memory_bytes__gte=0) & Q(pids__gte=0) & Q(waited_ms__gte=0),
                name="runtime_reservation_amounts_non_negative",
            )
        ]

    def __str__(self) -> str:
        return f"{self.handle_id} on {self.host_id}"
