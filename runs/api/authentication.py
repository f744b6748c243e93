"""Token authentication that looks a key up only when it could be one: a
key with a NUL or any character outside the alphabet of generated keys is
refused before the database sees it (PostgreSQL rejects NUL in a query)."""

import re

from rest_framework import authentication, exceptions

# rest_framework.authtoken keys are 40 hexadecimal characters.
_TOKEN_KEY = re.compile(r"[0-9A-Za-z]{1,40}")


def plausible_token_key(key: str) -> bool:
    return _TOKEN_KEY.fullmatch(key) is not None


class StrictTokenAuthentication(authentication.TokenAuthentication):
    def authenticate_credentials(self, key):
        if not plausible_token_key(key):
            raise exceptions.AuthenticationFailed("Invalid token.")
        return super().authenticate_credentials(key)
