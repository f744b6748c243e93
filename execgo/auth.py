"""Authentication backends, the client's address, and the per-username
login throttle.

A login failure locks out one username *from one address*
(``AXES_LOCKOUT_PARAMETERS``): an attacker who knows an approver's username
can lock only their own address out, never the approver signing in from
anywhere else. The address is the TCP peer's (``client_address``); an
``X-Forwarded-For`` header is believed only when it arrives from a proxy
named in ``EXECGO_TRUSTED_PROXIES``, and then only its right-most entry that
is not such a proxy (the one the proxy itself appended): whatever a client
writes into the header sits to the left of it.

Many failures for one username from many addresses (a spray across a
botnet) lock nothing: they slow down every further login attempt for that
username (``LoginThrottleMiddleware``), by a delay that grows with the
failures and never exceeds ``EXECGO_LOGIN_THROTTLE_MAX_S``, before the
password is checked. The approver still signs in, at most that much later.
"""

import asyncio
import ipaddress
import logging
import time

from asgiref.sync import sync_to_async
from axes.backends import AxesStandaloneBackend
from axes.models import AccessAttempt
from django.conf import settings
from django.db.models import Sum
from django.urls import reverse
from django.utils import timezone

from execgo.dual import SyncAndAsyncMiddleware

logger = logging.getLogger(__name__)

THROTTLE_HEADER = "X-Login-Throttle"  # seconds the attempt was held back
FIRST_DELAY_S = 0.25  # the first throttled attempt's delay; it doubles with each failure after


class LoginRateLimitBackend(AxesStandaloneBackend):
    """django-axes' lockout check, for logins that come with a request.

    ``authenticate()`` without a request comes from code on this machine
    (a management command, a test client's ``login``), never from the
    network, so there is nothing to rate-limit and it passes through.
    """

    def authenticate(self, request, username=None, password=None, **kwargs):
        if request is None:
            return None
        return super().authenticate(request, username=username, password=password, **kwargs)


def _address(text: str) -> str | None:
    try:
        return str(ipaddress.ip_address(text.strip()))
    except ValueError:
        return None


def client_address(request) -> str:
    """The address of the client (``AXES_CLIENT_IP_CALLABLE``): the TCP peer,
    or, when the peer is a trusted proxy, the right-most address of
    ``X-Forwarded-For`` that is not a trusted proxy."""
    peer = request.META.get("REMOTE_ADDR", "") or ""
    trusted = set(settings.EXECGO_TRUSTED_PROXIES)
    if not trusted or peer not in trusted:
        return peer
    for entry in reversed(request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")):
        address = _address(entry)
        if address is None:
            return peer  # not what a proxy writes: believe nothing further left
        if address not in trusted:
            return address
    return peer


def username_failures(username: str) -> int:
    """Failed logins for ``username`` within the cool-off time, from every address."""
    since = timezone.now() - settings.AXES_COOLOFF_TIME
    total = AccessAttempt.objects.filter(username=username, attempt_time__gte=since).aggregate(
        total=Sum("failures_since_start"))["total"]
    return total or 0


def throttle_delay(failures: int) -> float:
    """Seconds to hold back a login attempt for a username with ``failures``
    recent failures: none below ``EXECGO_LOGIN_THROTTLE_AFTER``, then
    doubling from FIRST_DELAY_S, capped at ``EXECGO_LOGIN_THROTTLE_MAX_S``."""
    excess = failures - settings.EXECGO_LOGIN_THROTTLE_AFTER
    if excess < 0:
        return 0.0
    return min(FIRST_DELAY_S * 2 ** min(excess, 16), settings.EXECGO_LOGIN_THROTTLE_MAX_S)


class LoginThrottleMiddleware(SyncAndAsyncMiddleware):
    """Holds back a login POST for a username under a spray of failures.

    Under Daphne it runs asynchronously (every middleware below it can, see
    ``execgo.logs.RequestContextMiddleware``; tests/pages/test_login_lockout.py
    holds that): there every synchronous view of a process runs on one
    thread, so a ``time.sleep`` would hold up every page of every user, and
    the attacker's failures would slow the whole site, while an
    ``asyncio.sleep`` holds up only this request. Under WSGI, where each
    request has a thread of its own, it runs synchronously.
    """

    def __call__(self, request):
        if self.is_async:
            return self.__acall__(request)
        delay = _login_delay(request)
        if delay:
            time.sleep(delay)
        return _mark(self.get_response(request), delay)

    async def __acall__(self, request):
        # Only a login POST reads the failures (in the thread); anything else passes at once.
        delay = await sync_to_async(_login_delay)(request) if _is_login_post(request) else 0.0
        if delay:
            await asyncio.sleep(delay)
        return _mark(await self.get_response(request), delay)


def _is_login_post(request) -> bool:
    return request.method == "POST" and request.path in (reverse("login"), reverse("admin:login"))


def _login_delay(request) -> float:
    if not _is_login_post(request):
        return 0.0
    username = request.POST.get("username", "")
    delay = throttle_delay(username_failures(username)) if username else 0.0
    if delay:
        logger.warning("login for a username under repeated failures held back %.2fs", delay)
    return delay


def _mark(response, delay: float):
    if delay:
        response[THROTTLE_HEADER] = f"{delay:.2f}"
    return response
