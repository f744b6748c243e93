"""Who sees what in the Django admin: a tenant's staff see their tenant only.

A superuser is the installation's operator and sees everything. Every other
staff user acts only within the tenant of their ``Membership``: every admin
model of every app is either

- ``TenantScopedAdmin``: rows reached from the model by its ``tenant_path``
  (``"tenant"``, ``"run__tenant"``, ``"membership__tenant"``, …). The scope
  holds for the changelist and its actions, the change, delete and history
  pages (an object of another tenant is a 404, as in the API and the pages),
  the relation filters (only values of the tenant's own rows), autocomplete
  and raw-id popups (they read the related model's admin queryset), and the
  forms: a foreign key offers only the tenant's rows, a new object lands in
  the staff user's tenant, and a save that would leave the tenant is refused
  (403, rolled back with the admin's transaction); or
- ``SuperuserOnlyAdmin``: installation-wide rows (policy, hosts, schedules,
  login attempts, groups) that no tenant owns.

``scope_site`` runs once the admin modules are loaded and makes every model
registered without either mixin superuser-only, so a model registered later
(by an app or a library) is closed to tenant staff until someone decides
otherwise.
"""

from django.contrib import admin
from django.contrib.admin.utils import get_fields_from_path
from django.core.exceptions import FieldDoesNotExist, PermissionDenied
from django.http import Http404

from runs.models import Tenant
from runtime.admin import PrettyJSONMixin


def is_operator(request) -> bool:
    user = request.user
    return user.is_active and user.is_superuser


def staff_tenant_id(request) -> int | None:
    """The tenant a (non-superuser) staff user acts in; None: no tenant, no rows."""
    membership = getattr(request.user, "membership", None)  # cached on the user for the request
    return membership.tenant_id if membership is not None else None


class ScopedChoicesMixin:
    """Foreign-key and many-to-many choices (selects, raw ids, autocomplete
    validation) limited to what the related model's admin shows the user."""

    def get_field_queryset(self, db, db_field, request):
        queryset = super().get_field_queryset(db, db_field, request)
        related_admin = self.admin_site._registry.get(db_field.remote_field.model)
        if is_operator(request) or not isinstance(related_admin, TenantScopedAdmin):
            return queryset
        return related_admin.get_queryset(request).using(db)


class TenantScopedAdmin(ScopedChoicesMixin):
    """Mixed in before ``admin.ModelAdmin`` (or a library's admin class)."""

    tenant_path: str = ""  # the lookup from the model to its Tenant

    def get_queryset(self, request):
        queryset = super().get_queryset(request)
        if is_operator(request):
            return queryset
        tenant_id = staff_tenant_id(request)
        if tenant_id is None:
            return queryset.none()
        return queryset.filter(**{self.tenant_path: tenant_id})

    def get_object(self, request, object_id, from_field=None):
        # Out of scope and missing look the same, and are a 404 rather than
        # the admin's redirect to its index.
        obj = super().get_object(request, object_id, from_field)
        if obj is None:
            raise Http404(f"no {self.opts.verbose_name} {object_id!r}")
        return obj

    def has_add_permission(self, request, *args) -> bool:
        if not is_operator(request) and staff_tenant_id(request) is None:
            return False
        return super().has_add_permission(request, *args)

    def get_list_filter(self, request):
        filters = super().get_list_filter(request)
        if is_operator(request):
            return filters
        return [self._scoped_filter(item) for item in filters]

    def _scoped_filter(self, item):
        """A relation filter lists every row of the related model; the
        related-only one lists those the tenant's own rows point to."""
        if isinstance(item, str):
            path = item
        elif isinstance(item, tuple) and item[1] is admin.RelatedFieldListFilter:
            path = item[0]
        else:
            return item  # a filter class of its own: it reads the queryset it is given
        try:
            field = get_fields_from_path(self.model, path)[-1]
        except FieldDoesNotExist:
            return item
        return (path, admin.RelatedOnlyFieldListFilter) if field.is_relation else item

    def save_model(self, request, obj, form, change):
        if not change and not is_operator(request) and _has_tenant_column(obj):
            obj.tenant_id = staff_tenant_id(request)
        super().save_model(request, obj, form, change)

    def save_related(self, request, form, formsets, change):
        super().save_related(request, form, formsets, change)
        # Last write of the admin's transaction: nothing a form offered can
        # move the object out of the tenant, but if it did, all of it rolls back.
        if not is_operator(request) and not self.get_queryset(request).filter(pk=form.instance.pk).exists():
            raise PermissionDenied("the object would leave your tenant")


class SuperuserOnlyAdmin:
    """No view, add, change or delete for anyone but a superuser."""

    def has_module_permission(self, request) -> bool:
        return is_operator(request) and super().has_module_permission(request)

    def has_view_permission(self, request, obj=None) -> bool:
        return is_operator(request) and super().has_view_permission(request, obj)

    def has_add_permission(self, request, *args) -> bool:
        return is_operator(request) and super().has_add_permission(request, *args)

    def has_change_permission(self, request, obj=None) -> bool:
        return is_operator(request) and super().has_change_permission(request, obj)

    def has_delete_permission(self, request, obj=None) -> bool:
        return is_operator(request) and super().has_delete_permission(request, obj)


def _has_tenant_column(obj) -> bool:
    try:
        field = obj._meta.get_field("tenant")
    except FieldDoesNotExist:
        return False
    return field.is_relation and field.related_model is Tenant


def scope_site(site: admin.AdminSite) -> None:
    """Make every model registered on ``site`` without a scope superuser-only."""
    for model, model_admin in list(site._registry.items()):
        if isinstance(model_admin, TenantScopedAdmin):
            if not model_admin.tenant_path:
                raise TypeError(f"{type(model_admin).__name__} is tenant-scoped but names no tenant_path")
            continue
        if isinstance(model_admin, SuperuserOnlyAdmin):
            continue
        scoped = type(type(model_admin).__name__, (SuperuserOnlyAdmin, type(model_admin)), {
            "__module__": type(model_admin).__module__,
            "__doc__": f"{type(model_admin).__doc__ or ''} (superuser-only: see runs.admin_scope)",
        })
        site.unregister(model)
        site.register(model, scoped)


class ReadOnlyAdminMixin(PrettyJSONMixin):
    """No add, change or delete for anyone, superusers included: a superuser
    passes every ``has_perm`` check, so the permission methods themselves
    have to say no. JSON columns are shown pretty-printed."""

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
