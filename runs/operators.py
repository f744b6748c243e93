"""Who reads what only operators read: the figures of /metrics and the
details of /readyz (check names, errors, every worker host's kernel, uid
and sandbox tools).

- ``Authorization: Bearer <EXECGO_METRICS_TOKEN>``: the scraper's token,
  compared in constant time. It opens /metrics and /readyz's details, so
  one secret serves the monitoring system.
- A staff user, by session (an operator's browser) or by that user's API
  token (``Authorization: Token <key>``, as the API authenticates): /readyz's
  details only. /metrics is the scraper's, and a browser has no need of it.

Nobody else learns anything: no host, version or tenant is in what an
anonymous caller gets, and a refusal reads the same whatever is configured.
"""

import hmac

from django.conf import settings
from django.http import HttpRequest, JsonResponse
from rest_framework.exceptions import APIException
from rest_framework.request import Request
from rest_framework.settings import api_settings

from runs.errors import ErrorCode, error_envelope

BEARER = "bearer "


def has_metrics_token(request: HttpRequest) -> bool:
    expected = settings.EXECGO_METRICS_TOKEN
    header = request.headers.get("Authorization", "")
    if not expected or header[:len(BEARER)].lower() != BEARER:
        return False
    given = header[len(BEARER):].strip()
    # compare_digest on bytes: a str with non-ASCII characters would raise.
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode())


def metrics_allowed(request: HttpRequest) -> bool:
    if settings.EXECGO_METRICS_TOKEN:
        return has_metrics_token(request)
    return settings.EXECGO_METRICS_PUBLIC


def _staff(request: HttpRequest) -> bool:
    """The session's user, or the user of an API token, the way the API
    authenticates (whatever its authentication classes are)."""
    session_user = getattr(request, "user", None)
    if session_user is not None and session_user.is_authenticated:
        return session_user.is_active and session_user.is_staff
    if not request.headers.get("Authorization"):
        return False
    authenticators = [cls() for cls in api_settings.DEFAULT_AUTHENTICATION_CLASSES]
    try:
        user = Request(request, authenticators=authenticators).user
    except APIException:  # a wrong or revoked token: no details
        return False
    return bool(user is not None and user.is_authenticated and user.is_active and user.is_staff)


def readiness_details_allowed(request: HttpRequest) -> bool:
    return has_metrics_token(request) or _staff(request)


def refused() -> JsonResponse:
    """401, the same body whether a token is configured, missing or wrong."""
    body = {"error": error_envelope(ErrorCode.DENIED, "a valid bearer token is required", source="api")}
    response = JsonResponse(body, status=401)
    response["WWW-Authenticate"] = 'Bearer realm="execgo"'
    return response
