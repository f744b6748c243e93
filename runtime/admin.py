"""Read-only admin for the resource ledger: operators look, runtime.ledger writes."""

from django.contrib import admin

from runtime.models import HostCapacity, Reservation


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(HostCapacity)
class HostCapacityAdmin(ReadOnlyAdmin):
    list_display = (
        "host",
        "task_slots_reserved",
        "task_slots_capacity",
        "memory_bytes_reserved",
        "memory_bytes_capacity",
        "pids_reserved",
        "pids_capacity",
        "last_seen",
    )
    search_fields = ("host",)


@admin.register(Reservation)
class ReservationAdmin(ReadOnlyAdmin):
    list_display = ("handle_id", "host", "task_slots", "memory_bytes", "pids", "waited_ms", "reserved_at")
    list_filter = ("host",)
    search_fields = ("handle_id",)
