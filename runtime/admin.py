"""Read-only admin for the resource ledger: operators look, runtime.ledger writes.

Hosts are the installation's, not a tenant's: the project closes these pages
to everyone but superusers (``runs.admin_scope.scope_site``; runtime knows
nothing of tenants).

Also home of the display helpers every ExecGo admin shares (pretty JSON,
badges): runtime is the bottom tier, so ``runs.admin`` may import them from
here, while the reverse would break the layering.
"""

import json
from functools import cache

from django.contrib import admin
from django.db import models
from django.utils.html import format_html

from runtime.models import HostCapacity, Reservation

ADMIN_CSS = "execgo/admin.css"


def pretty_json(value):
    """A JSON value as indented, escaped text in a ``<pre>`` (the CSS caps
    its height, so a large plan scrolls instead of stretching the page)."""
    if value is None:
        return "-"  # what the admin shows for any other empty value
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
    return format_html('<pre class="execgo-json">{}</pre>', text)


def badge(text: str, group: str):
    """A status as a coloured pill; the text itself is the status, so the
    colour only helps the eye and is never the sole carrier."""
    return format_html('<span class="badge badge-{}">{}</span>', group, text)


@cache
def _json_display(field: models.JSONField):
    # Cached so that the very same callable lands in the fieldsets and in
    # readonly_fields: the admin pairs the two by membership, which for a
    # function means identity.
    def show(obj):
        return pretty_json(getattr(obj, field.attname))

    show.__name__ = field.name  # keeps the row's CSS class field-<name>
    return admin.display(description=field.verbose_name)(show)


class PrettyJSONMixin:
    """Shows every JSONField of the model, on a ModelAdmin or an inline, as
    read-only pretty JSON, wherever the field would appear (declared
    fields, fieldsets or the admin's default of all fields)."""

    class Media:
        css = {"all": (ADMIN_CSS,)}

    def _json_displays(self) -> dict:
        return {f.name: _json_display(f) for f in self.model._meta.fields if isinstance(f, models.JSONField)}

    def _pretty(self, names) -> list:
        displays = self._json_displays()
        shown = [
            tuple(self._pretty(name)) if isinstance(name, (list, tuple))  # fields sharing one fieldset line
            else displays.get(name, name) if isinstance(name, str)
            else name
            for name in names
        ]
        return list(dict.fromkeys(shown))  # a JSON field listed read-only is also among all the displays

    def get_exclude(self, request, obj=None):
        # Out of the form, so that the admin's default field list (the form's
        # fields, then the read-only ones) shows each JSON field once, as its
        # display.
        return [*(super().get_exclude(request, obj) or ()), *self._json_displays()]

    def get_fields(self, request, obj=None):
        return self._pretty(super().get_fields(request, obj))

    def get_fieldsets(self, request, obj=None):
        return [(name, {**options, "fields": self._pretty(options["fields"])})
                for name, options in super().get_fieldsets(request, obj)]

    def get_readonly_fields(self, request, obj=None):
        # Every display is read-only, listed or not: the admin's form takes the
        # shown fields minus these, and a display left in would be an unknown
        # form field.
        return self._pretty([*super().get_readonly_fields(request, obj), *self._json_displays().values()])


class ReadOnlyAdmin(PrettyJSONMixin, admin.ModelAdmin):
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
    list_display = ("handle_id", "host", "task_slots", "memory_bytes", "pids", "owner_pid", "waited_ms", "reserved_at")
    list_filter = ("host",)
    search_fields = ("handle_id",)
