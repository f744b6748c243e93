"""The login lockout cannot lock a real approver out: failures lock one
username from one address (the TCP peer's, or what a trusted proxy
appended, never what a client wrote into X-Forwarded-For); failures for one
username from many addresses slow its logins down, boundedly, and lock
nothing; the API's token path knows none of it.

Against the real login views with the Django test client; the addresses
are documentation ranges written into REMOTE_ADDR (no packet is sent)."""

import time

import pytest
from axes.models import AccessAttempt
from django.test import Client

from approvals.models import APPROVERS_GROUP
from execgo.auth import THROTTLE_HEADER, LoginThrottleMiddleware, throttle_delay
from tests.conftest import make_user, token_client

pytestmark = pytest.mark.django_db

ATTACKER, APPROVER_DESK = "192.0.2.66", "198.51.100.7"
SPRAY = [f"203.0.113.{number}" for number in range(1, 5)]  # four more attacker addresses
LOGIN = "/accounts/login/"


@pytest.fixture
def approver(tenant):
    return make_user("approver", tenant, groups=(APPROVERS_GROUP,))


@pytest.fixture
def quick_throttle(settings):
    settings.AXES_FAILURE_LIMIT = 5
    settings.EXECGO_LOGIN_THROTTLE_AFTER = 10
    settings.EXECGO_LOGIN_THROTTLE_MAX_S = 0.5
    return settings


def attempt(address: str, password: str, *, path: str = LOGIN, **headers):
    client = Client(REMOTE_ADDR=address)
    return client, client.post(path, {"username": "approver", "password": password}, **headers)


def signed_in(client: Client) -> bool:
    return "_auth_user_id" in client.session


def test_twenty_failures_from_one_address_lock_only_that_address(quick_throttle, approver):
    codes = [attempt(ATTACKER, f"guess-{number}")[1].status_code for number in range(20)]
    assert codes[:4] == [200] * 4  # the form again, with its error
    assert codes[5:] == [429] * 15  # locked out from the fifth failure on

    locked_client, locked = attempt(ATTACKER, "pw-approver")
    assert locked.status_code == 429 and not signed_in(locked_client)  # the right password does not help at A
    assert b"Too many failed logins" in locked.content

    desk, response = attempt(APPROVER_DESK, "pw-approver")
    assert response.status_code == 302 and signed_in(desk)
    assert desk.get("/").status_code == 200

    # Signing in at B reset B's record only: A stays locked.
    assert attempt(ATTACKER, "pw-approver")[1].status_code == 429
    assert set(AccessAttempt.objects.values_list("ip_address", flat=True)) == {ATTACKER}


def test_a_spray_from_many_addresses_slows_the_username_down_but_never_locks_it(quick_throttle, approver):
    for address in [ATTACKER, *SPRAY]:
        for number in range(5):
            attempt(address, f"guess-{number}")
    assert sum(AccessAttempt.objects.values_list("failures_since_start", flat=True)) >= 20

    started = time.monotonic()
    desk, response = attempt(APPROVER_DESK, "pw-approver")
    elapsed = time.monotonic() - started
    assert response.status_code == 302 and signed_in(desk)  # not locked: the approver is in
    held_back = float(response[THROTTLE_HEADER])
    assert held_back == quick_throttle.EXECGO_LOGIN_THROTTLE_MAX_S  # the cap, not 0.25 * 2**10
    assert elapsed >= held_back  # the delay happened before the answer

    # Every address of the spray is locked for the username on its own.
    assert all(attempt(address, "pw-approver")[1].status_code == 429 for address in SPRAY)


def test_the_delay_starts_at_the_threshold_and_is_bounded(quick_throttle, approver):
    assert [throttle_delay(failures) for failures in (0, 9, 10, 11, 12, 13, 1000)] == [
        0.0, 0.0, 0.25, 0.5, 0.5, 0.5, 0.5]
    quick_throttle.EXECGO_LOGIN_THROTTLE_MAX_S = 2.0
    assert [throttle_delay(failures) for failures in (10, 11, 12, 13, 14, 10**9)] == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]

    for address in SPRAY[:2]:  # ten failures: the threshold
        for number in range(5):
            assert THROTTLE_HEADER not in attempt(address, f"guess-{number}")[1]
    _, response = attempt(APPROVER_DESK, "wrong")
    assert (response.status_code, response[THROTTLE_HEADER]) == (200, "0.25")


def test_a_forged_forwarded_for_neither_frees_the_attacker_nor_locks_out_anyone_else(quick_throttle, approver):
    for number in range(6):
        attempt(ATTACKER, f"guess-{number}", HTTP_X_FORWARDED_FOR=f"198.51.100.{number + 20}")
    # The lock is on the peer's address, whatever the header said.
    assert set(AccessAttempt.objects.values_list("ip_address", flat=True)) == {ATTACKER}
    assert attempt(ATTACKER, "pw-approver", HTTP_X_FORWARDED_FOR="198.51.100.99")[1].status_code == 429
    # Naming the approver's desk in the header did not lock the desk.
    for number in range(6):
        attempt(ATTACKER, f"more-{number}", HTTP_X_FORWARDED_FOR=APPROVER_DESK)
    desk, response = attempt(APPROVER_DESK, "pw-approver")
    assert response.status_code == 302 and signed_in(desk)


def test_behind_a_trusted_proxy_the_address_is_the_one_the_proxy_appended(quick_throttle, approver):
    quick_throttle.EXECGO_TRUSTED_PROXIES = ["127.0.0.1"]
    proxy = "127.0.0.1"
    # The attacker writes the approver's address into the header; the proxy appends the attacker's real one.
    for number in range(6):
        attempt(proxy, f"guess-{number}", HTTP_X_FORWARDED_FOR=f"{APPROVER_DESK}, {ATTACKER}")
    assert set(AccessAttempt.objects.values_list("ip_address", flat=True)) == {ATTACKER}

    desk, response = attempt(proxy, "pw-approver", HTTP_X_FORWARDED_FOR=APPROVER_DESK)
    assert response.status_code == 302 and signed_in(desk)
    assert attempt(proxy, "pw-approver", HTTP_X_FORWARDED_FOR=ATTACKER)[1].status_code == 429
    # A header that is not a list of addresses is not believed past its bad entry.
    for number in range(5):
        attempt(proxy, f"junk-{number}", HTTP_X_FORWARDED_FOR="not-an-address")
    assert AccessAttempt.objects.filter(ip_address=proxy).exists()


def test_the_admin_login_is_locked_per_address_too(quick_throttle, approver):
    approver.is_staff = True
    approver.save(update_fields=["is_staff"])
    for number in range(6):
        attempt(ATTACKER, f"guess-{number}", path="/admin/login/")
    assert attempt(ATTACKER, "pw-approver", path="/admin/login/")[1].status_code == 429
    desk, response = attempt(APPROVER_DESK, "pw-approver", path="/admin/login/")
    assert response.status_code == 302 and signed_in(desk)


def test_the_api_token_path_is_unaffected(quick_throttle, approver):
    for address in [ATTACKER, *SPRAY]:
        for number in range(5):
            attempt(address, f"guess-{number}")
    api = token_client(approver)
    for address in (ATTACKER, APPROVER_DESK):
        response = api.get("/api/v1/runs", REMOTE_ADDR=address)
        assert response.status_code == 200, response.content
        assert THROTTLE_HEADER not in response


def _throttle_in(handler) -> LoginThrottleMiddleware:
    """The throttle's instance in a handler's middleware chain."""
    layer = handler._middleware_chain  # each middleware behind Django's exception wrapper
    while not isinstance(layer, LoginThrottleMiddleware):
        layer = layer.__wrapped__ if hasattr(layer, "__wrapped__") else layer.get_response
    return layer


def test_under_daphne_the_throttle_waits_on_the_event_loop_and_under_wsgi_in_its_thread():
    # Every middleware below it must be able to run asynchronously: one that
    # cannot would put the throttle's sleep on the one thread all of a
    # process's synchronous views share.
    from django.core.handlers.asgi import ASGIHandler
    from django.core.handlers.wsgi import WSGIHandler

    assert _throttle_in(ASGIHandler()).is_async is True
    assert _throttle_in(WSGIHandler()).is_async is False
