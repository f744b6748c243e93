"""Issuing, checking and revoking API tokens (``runs.models.ApiToken``).

A key is 64 hexadecimal characters (256 random bits) and exists only in the
answer to whoever created it: the row holds its SHA-256 digest and its first
characters. Tokens of the earlier scheme (DRF's authtoken, 40 hexadecimal
characters stored as they were) were turned into digests by migration 0018
and keep working as they are.

A key is looked up only when it could be one (``plausible_token_key``: a NUL
or any character outside the alphabet of keys never reaches the database,
and PostgreSQL refuses NUL in a query), by its prefix; the digests are then
compared in constant time. Every check reads the row, so a revocation or an
expiry takes effect at the next request.

Every creation and revocation writes an audit row in the tenant's chain of
the token's user, naming the token by id, name and prefix, never its key;
deleting a user revokes its live tokens first, audited the same way.
"""

import hashlib
import hmac
import re
import secrets
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from runs.audit import audit
from runs.models import ApiToken, AuditEvent, Membership
from runs.models.tokens import KEY_PREFIX_CHARS

KEY_BYTES = 32
# New keys are 64 lowercase hexadecimal characters, the earlier scheme's 40;
# anything else of the same alphabet is refused without a query as well.
_TOKEN_KEY = re.compile(r"[0-9A-Za-z]{1,64}")
LAST_USED_GRANULARITY_S = 60


def plausible_token_key(key: str) -> bool:
    return _TOKEN_KEY.fullmatch(key) is not None


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("ascii")).hexdigest()


def token_create(*, user, name: str = "", expires_at: datetime | None = None, actor=None,
                 caller: str = "") -> tuple[ApiToken, str]:
    """A new token for ``user`` and its key: the only time the key is known."""
    key = secrets.token_hex(KEY_BYTES)
    with transaction.atomic():
        token = ApiToken.objects.create(user=user, name=name, key_prefix=key[:KEY_PREFIX_CHARS],
                                        digest=key_digest(key), expires_at=expires_at)
        _audit(AuditEvent.TOKEN_CREATED, token, actor=actor, caller=caller)
    return token, key


def token_revoke(*, token: ApiToken, actor=None, caller: str = "") -> bool:
    """Revoke ``token``; False when it already was (nothing is written then)."""
    now = timezone.now()
    with transaction.atomic():
        # Compare-and-swap: of two revokes at once, one writes the audit row.
        if not ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=now):
            return False
        token.revoked_at = now
        _audit(AuditEvent.TOKEN_REVOKED, token, actor=actor, caller=caller)
    return True


def revoke_tokens_of_deleted_user(sender, instance, **kwargs) -> None:
    """``pre_delete`` of a user: the tokens the delete is about to take with
    it are revoked first, each with its audit row (while the user's
    membership still names the tenant's chain)."""
    for token in ApiToken.objects.select_related("user").filter(user=instance, revoked_at__isnull=True):
        token_revoke(token=token, caller="user deleted")


def token_authenticate(key: str) -> ApiToken | None:
    """The live token ``key`` is the key of (its ``user`` loaded and active),
    or None. Records the use, at most once a minute per token."""
    if not plausible_token_key(key):
        return None
    digest = key_digest(key)
    now = timezone.now()
    found = None
    # The user's membership and tenant come in the same read: every view asks for them next.
    for token in ApiToken.objects.select_related("user__membership__tenant").filter(
            key_prefix=key[:KEY_PREFIX_CHARS]):
        if hmac.compare_digest(token.digest, digest):
            found = token
    if found is None or found.revoked or found.expired(now) or not found.user.is_active:
        return None
    _record_use(found, now)
    return found


def _record_use(token: ApiToken, now: datetime) -> None:
    cutoff = now - timedelta(seconds=LAST_USED_GRANULARITY_S)
    if token.last_used_at is not None and token.last_used_at > cutoff:
        return  # the common case: no write at all
    # Conditional, so the requests of one minute write the row once however
    # many processes read the old value at the same time.
    ApiToken.objects.filter(pk=token.pk).filter(Q(last_used_at__isnull=True) | Q(last_used_at__lte=cutoff)).update(
        last_used_at=now)
    token.last_used_at = now


def _audit(event: AuditEvent, token: ApiToken, *, actor, caller: str) -> None:
    tenant_id = Membership.objects.filter(user_id=token.user_id).values_list("tenant_id", flat=True).first()
    audit(event, run_id=None, tenant_id=tenant_id, actor=actor, caller=caller, data={
        "token_id": token.pk, "user": token.user.get_username(), "name": token.name,
        "key_prefix": token.key_prefix, "expires_at": token.expires_at.isoformat() if token.expires_at else None,
    })
