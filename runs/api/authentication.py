"""The API's ``Authorization: Token <key>`` scheme, against the digests of
``runs.models.ApiToken`` (``runs.tokens``): a key that could not be one is
refused before the database sees it, and a revoked or expired token is
refused at once. The caller's tenant is bound to the request's log lines
here, where the token is known to be good (``execgo.logs``)."""

from rest_framework import authentication, exceptions
from structlog.contextvars import bind_contextvars

from runs.tokens import plausible_token_key, token_authenticate

__all__ = ["StrictTokenAuthentication", "plausible_token_key"]


class StrictTokenAuthentication(authentication.TokenAuthentication):
    keyword = "Token"

    def authenticate_credentials(self, key):
        token = token_authenticate(key)
        if token is None:
            raise exceptions.AuthenticationFailed("Invalid token.")
        membership = getattr(token.user, "membership", None)
        if membership is not None:
            bind_contextvars(tenant_id=membership.tenant_id)
        return token.user, token
