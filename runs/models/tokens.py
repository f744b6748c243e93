"""API tokens, stored as the SHA-256 digest of their key only.

The key is shown once, when the token is created (``runs.tokens``); the
database keeps its digest and its first ``KEY_PREFIX_CHARS`` characters, by
which a presented key is looked up (an index, not a secret: the digest is
then compared in constant time). A key is 256 random bits, so a plain
SHA-256 is enough: there is nothing to brute-force that a slow, salted hash
would protect. Revoking sets ``revoked_at``, kept as a record: the row stays
in the admin, refused from then on.
"""

from django.conf import settings
from django.db import models
from django.utils import timezone

KEY_PREFIX_CHARS = 8


class ApiToken(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100, blank=True, help_text="what the token is for, e.g. the agent's host")
    key_prefix = models.CharField(max_length=KEY_PREFIX_CHARS, db_index=True, editable=False)
    digest = models.CharField(max_length=64, unique=True, editable=False)  # SHA-256 of the key, hex
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    expires_at = models.DateTimeField(null=True, blank=True, help_text="empty: never expires")
    # Written at most once a minute per token (runs.tokens.LAST_USED_GRANULARITY_S).
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        verbose_name = "API token"
        ordering = ("-created_at", "-id")

    def __str__(self) -> str:
        return f"{self.name or 'token'} ({self.key_prefix}…)"

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    def expired(self, now=None) -> bool:
        return self.expires_at is not None and self.expires_at <= (now or timezone.now())
