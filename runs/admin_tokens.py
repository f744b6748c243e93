"""API tokens in the admin: listed per tenant (``TenantScopedAdmin``, never
a superuser's token for tenant staff), created with the key shown once on
the page that answers the form, revoked by an action. The key exists
nowhere after that page: neither in a message (the cookie and the session
would keep it) nor in a redirect. The digest is never shown either.

Tokens are neither edited nor deleted here: a token's rights are its user's,
its expiry is set when it is issued, and a revoked token stays listed as a
record. Creation and revocation go through ``runs.tokens``, which writes
their audit rows.
"""

from django.contrib import admin, messages
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.cache import add_never_cache_headers

from runs.admin_scope import TenantScopedAdmin, is_operator
from runs.models import ApiToken
from runs.tokens import token_create, token_revoke
from runtime.admin import badge

_NEW_KEY = "_execgo_new_token_key"  # the request attribute carrying the key to the page that shows it


@admin.display(description="state")
def token_state(token: ApiToken):
    if token.revoked:
        return badge("revoked", "closed-failed")
    if token.expired():
        return badge("expired", "closed-cancelled")
    return badge("live", "succeeded")


class RevokedFilter(admin.SimpleListFilter):
    title = "revoked"
    parameter_name = "revoked"

    def lookups(self, request, model_admin):
        return (("no", "live or expired"), ("yes", "revoked"))

    def queryset(self, request, queryset):
        if self.value() in ("yes", "no"):
            return queryset.filter(revoked_at__isnull=self.value() == "no")
        return queryset


@admin.register(ApiToken)
class ApiTokenAdmin(TenantScopedAdmin, admin.ModelAdmin):
    tenant_path = "user__membership__tenant"

    list_display = ("name", "user", "key_prefix", token_state, "created_at", "expires_at", "last_used_at",
                    "revoked_at")
    list_display_links = ("name", "key_prefix")
    list_select_related = ("user",)
    list_filter = (RevokedFilter, "created_at", "expires_at")
    search_fields = ("name", "user__username", "key_prefix")
    actions = ("revoke_selected",)
    add_fields = ("user", "name", "expires_at")
    shown_fields = ("user", "name", "key_prefix", "created_at", "expires_at", "last_used_at", "revoked_at")

    def get_queryset(self, request):
        tokens = super().get_queryset(request)
        return tokens if is_operator(request) else tokens.filter(user__is_superuser=False)

    def get_fields(self, request, obj=None):
        return self.add_fields if obj is None else self.shown_fields

    def get_readonly_fields(self, request, obj=None):
        return () if obj is None else self.shown_fields

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # revoke instead: the row stays as the record of what existed

    def save_model(self, request, obj, form, change):
        if change:
            return  # every field is read-only once issued
        token, key = token_create(user=obj.user, name=obj.name, expires_at=obj.expires_at, actor=request.user,
                                  caller="admin")
        obj.pk, obj.key_prefix, obj.digest, obj.created_at = token.pk, token.key_prefix, token.digest, token.created_at
        obj._state.adding = False
        setattr(request, _NEW_KEY, key)

    def response_add(self, request, obj, post_url_continue=None):
        key = getattr(request, _NEW_KEY, None)
        if key is None:
            return super().response_add(request, obj, post_url_continue)
        response = TemplateResponse(request, "admin/runs/apitoken/created.html", {
            **self.admin_site.each_context(request), "title": "API token created", "opts": self.opts,
            "token": obj, "key": key,
        })
        add_never_cache_headers(response)  # no cache, back button or proxy keeps the page with the key
        return response

    @admin.action(description="Revoke selected tokens", permissions=["change"])
    def revoke_selected(self, request, queryset):
        revoked = sum(token_revoke(token=token, actor=request.user, caller="admin")
                      for token in queryset.select_related("user").filter(revoked_at__isnull=True))
        self.message_user(request, f"{revoked} token(s) revoked at {timezone.now():%Y-%m-%d %H:%M:%S} UTC.",
                          messages.SUCCESS)
