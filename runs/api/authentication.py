"""The API's ``Authorization: Token <key>`` scheme, against the digests of
``runs.models.ApiToken`` (``runs.tokens``): a key that could not be one is
refused before the database sees it, and a revoked or expired token is
refused at once."""

from rest_framework import authentication, exceptions

from runs.tokens import plausible_token_key, token_authenticate

__all__ = ["StrictTokenAuthentication", "plausible_token_key"]


class StrictTokenAuthentication(authentication.TokenAuthentication):
    keyword = "Token"

    def authenticate_credentials(self, key):
        token = token_authenticate(key)
        if token is None:
            raise exceptions.AuthenticationFailed("Invalid token.")
        return token.user, token
