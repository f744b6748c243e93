"""Admin changes in the audit chain: who changed which policy rule, user,
group, membership or tenant, from what to what.

``AuditedAdminMixin`` goes before the ``ModelAdmin`` (or a library's admin
class) it audits. Each add, change or delete made through the admin writes
one ``admin_changed`` row with the acting user, in the admin's own
transaction (the change and its row commit together or not at all), on the
chain of the object's tenant (``audit_tenant_ids``; a global object, such as
a policy rule or a group, on the no-tenant chain; an object moved from one
tenant to another, on both). Its data::

    {"model": "policy.policyrule", "object_id": "7", "object_repr": "…",
     "action": "added" | "changed" | "deleted",
     "before": {field: value} | null, "after": {field: value} | null,
     "changed_fields": [...]}

``before`` and ``after`` are read from the database, not from the form, so a
service that rewrites what the form gave (``policy_rule_save``) is recorded
as stored. Many-to-many fields (a user's groups and permissions, a group's
permissions) are the sorted names of what is linked. Secret columns
(``audit_secret_fields``: a password hash, a webhook secret) never leave
the database: a changed one is named in ``changed_fields`` and shown as
``"password changed"`` (``"<field> changed"``), nothing more. A save that
changed nothing writes no row.

Only the admin is audited here, not every save: the other writers of these
tables are the bootstrap command and migrations, run by whoever holds the
machine (and so the database) and printing what they did, and the code's own
services (``policy_rule_save`` already moves the policy version a decision
names). A ``post_save`` signal would record those without an actor and
every test factory's row besides, and the house style keeps such logic out
of signals.
"""

from datetime import date, datetime
from decimal import Decimal
from typing import Any
from uuid import UUID

from django.contrib.admin.utils import unquote
from django.db import transaction

from runs.audit import audit
from runs.models import AuditEvent, Membership

ADDED, CHANGED, DELETED = "added", "changed", "deleted"


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Decimal | UUID):
        return str(value)
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    return str(value)


class AuditedAdminMixin:
    """Writes an ``admin_changed`` audit row for each add, change and delete
    made through this admin (the list page's inline edits and the delete
    action included)."""

    audit_secret_fields: frozenset[str] = frozenset()  # compared, never recorded
    audit_skip_fields: frozenset[str] = frozenset()  # bookkeeping not worth a diff (last_login)

    # --- what an object is, for the log ------------------------------------

    def audit_snapshot(self, obj) -> dict[str, Any]:
        """The stored values of ``obj``'s columns and many-to-many links,
        secret ones included (``audit_data`` takes them out)."""
        values: dict[str, Any] = {}
        for field in obj._meta.concrete_fields:
            if field.primary_key or field.name in self.audit_skip_fields:
                continue
            if getattr(field, "auto_now", False) or getattr(field, "auto_now_add", False):
                continue
            values[field.name] = _jsonable(field.value_from_object(obj))
        for field in obj._meta.many_to_many:
            if field.name not in self.audit_skip_fields:
                values[field.name] = sorted(str(item) for item in getattr(obj, field.name).all())
        return values

    def audit_stored(self, obj) -> dict[str, Any] | None:
        """The snapshot of the row as the database holds it now (None: gone)."""
        if obj is None or obj.pk is None:
            return None
        stored = type(obj)._base_manager.filter(pk=obj.pk).first()
        return None if stored is None else self.audit_snapshot(stored)

    def audit_tenant_ids(self, obj, before: dict | None, after: dict | None) -> list[int | None]:
        """The chains the row goes on: the tenant the object was in and the
        one it is in (one row each when they differ); ``[None]`` for an
        installation-wide object."""
        tenants = [values["tenant"] for values in (before, after) if values is not None and "tenant" in values]
        return list(dict.fromkeys(tenants)) or [None]

    def audit_data(self, obj, action: str, before: dict | None, after: dict | None) -> dict[str, Any] | None:
        """The row's data, or None when nothing changed."""
        fields = sorted(set(before or {}) | set(after or {}))
        if action == CHANGED:
            changed = [name for name in fields if (before or {}).get(name) != (after or {}).get(name)]
            if not changed:
                return None
        elif action == ADDED:
            changed = [name for name in fields if name not in self.audit_secret_fields or (after or {}).get(name)]
        else:
            changed = []

        def public(values: dict | None) -> dict | None:
            if values is None:
                return None
            return {name: value for name, value in values.items() if name not in self.audit_secret_fields}

        data = {"model": obj._meta.label_lower, "object_id": str(obj.pk), "object_repr": str(obj)[:200],
                "action": action, "before": public(before), "after": public(after), "changed_fields": changed}
        for name in self.audit_secret_fields:
            if name in changed and after is not None:
                data["after"][name] = f"{name} changed"
        return data

    def audit_write(self, request, obj, action: str, before: dict | None, after: dict | None) -> None:
        data = self.audit_data(obj, action, before, after)
        if data is None:
            return
        for tenant_id in self.audit_tenant_ids(obj, before, after):
            audit(AuditEvent.ADMIN_CHANGED, run_id=None, tenant_id=tenant_id, actor=request.user, caller="admin",
                  data=data)

    # --- the admin's hooks ---------------------------------------------------

    def _remember_before(self, request, obj) -> None:
        if not hasattr(request, "_audit_before"):
            request._audit_before = {}
        request._audit_before[(type(obj), obj.pk)] = self.audit_stored(obj)

    def _recall_before(self, request, obj) -> dict | None:
        return getattr(request, "_audit_before", {}).pop((type(obj), obj.pk), None)

    def save_form(self, request, form, change):
        # Called before anything is written (change page and the list's inline
        # edits alike); the form has already copied its values onto the
        # instance, so "before" is read from the database.
        if change:
            self._remember_before(request, form.instance)
        return super().save_form(request, form, change)

    def log_addition(self, request, obj, message):
        # Called after save_model and save_related, inside the admin's transaction.
        self.audit_write(request, obj, ADDED, None, self.audit_stored(obj))
        return super().log_addition(request, obj, message)

    def log_change(self, request, obj, message):
        self.audit_write(request, obj, CHANGED, self._recall_before(request, obj), self.audit_stored(obj))
        return super().log_change(request, obj, message)

    def log_deletions(self, request, queryset):
        # Called before the delete (the delete page and the delete action).
        for obj in queryset:
            self.audit_write(request, obj, DELETED, self.audit_snapshot(obj), None)
        return super().log_deletions(request, queryset)

    def response_action(self, request, queryset):
        # The delete action logs, then deletes: one transaction, so a delete
        # that fails takes its audit rows with it.
        with transaction.atomic():
            return super().response_action(request, queryset)


class AuditedUserAdminMixin(AuditedAdminMixin):
    """Users: their tenant is their membership's; the password hash is a
    secret; ``last_login`` is written by every sign-in, not by an admin."""

    audit_secret_fields = frozenset({"password"})
    audit_skip_fields = frozenset({"last_login"})

    def audit_snapshot(self, obj) -> dict[str, Any]:
        values = super().audit_snapshot(obj)
        # A user an operator adds joins a tenant only later (a Membership of
        # its own, audited there): until then the user is no tenant's.
        values["tenant"] = Membership.objects.filter(user_id=obj.pk).values_list("tenant_id", flat=True).first()
        return values

    def user_change_password(self, request, id, form_url=""):
        # Django's password page saves the form itself, without save_form:
        # remember the stored hash first, and keep the change and its audit
        # row in one transaction.
        with transaction.atomic():
            if request.method == "POST":
                user = self.get_queryset(request).filter(pk=unquote(id)).first()
                if user is not None:
                    self._remember_before(request, user)
            return super().user_change_password(request, id, form_url)
