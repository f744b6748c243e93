"""A live page's websocket ends with its session, against a live Daphne
server: a logout (in the browser, whose script then goes to the login page
instead of reconnecting), a password change, a deactivation, a removal from
the tenant or a move to another, and a removal from the approvers group on
the approvals stream. The changes other than the logout are made in this
test process, not the server's: the Redis layer tells the server at once,
the embedded default's periodic check sees them within a second or so."""

import asyncio
import json
import re
import time
from datetime import datetime, timedelta, timezone

import pytest
from django.contrib.auth.models import Group, User
from django.contrib.sessions.models import Session
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from runs.models import Membership
from runs.sessions import CLOSE_ACCESS_LOST, CLOSE_SESSION_ENDED
from tests.conftest import make_user
from tests.pages.conftest import PASSWORD, log_in, session_cookie
from tests.pages.test_live_relay import headers, run_async, ws_url

pytestmark = pytest.mark.django_db(transaction=True)

BOUND_S = 10.0  # generous: the design closes within about a second
QUIET_S = 3.0  # three periodic checks


async def _ready(socket) -> None:
    while json.loads(await asyncio.wait_for(socket.recv(), 30))["type"] != "ready":
        pass


async def _closed_after(url: str, cookie: str, change) -> tuple[int | None, float]:
    """Open, wait for the stream to be ready, make ``change`` (in a thread:
    it uses the ORM), and return the close code and how long it took."""
    async with connect(url, additional_headers=headers(cookie), origin="http://127.0.0.1") as socket:
        await _ready(socket)
        await asyncio.to_thread(change)
        started = time.monotonic()
        try:
            while time.monotonic() - started < BOUND_S:
                await asyncio.wait_for(socket.recv(), BOUND_S)
        except (ConnectionClosed, TimeoutError):
            pass
        return socket.close_code, time.monotonic() - started


def closed_after(live_web, user, change, *, scope: str = "runs") -> tuple[int | None, float]:
    return run_async(_closed_after(ws_url(live_web, scope=scope, after=0), session_cookie(user), change))


def test_a_password_change_closes_the_socket(live_web, agent):
    def change():
        user = User.objects.get(pk=agent.pk)
        user.set_password("another-long-password")
        user.save()

    code, took = closed_after(live_web, agent, change)
    assert code == CLOSE_SESSION_ENDED and took < BOUND_S


def test_a_deactivation_closes_the_socket(live_web, agent):
    def change():
        user = User.objects.get(pk=agent.pk)
        user.is_active = False
        user.save()

    assert closed_after(live_web, agent, change)[0] == CLOSE_SESSION_ENDED


def test_a_change_no_signal_announces_is_seen_by_the_periodic_check(live_web, agent):
    code, took = closed_after(live_web, agent, lambda: User.objects.filter(pk=agent.pk).update(is_active=False))
    assert code == CLOSE_SESSION_ENDED and took < BOUND_S


def test_a_removal_from_the_tenant_closes_the_socket(live_web, agent):
    code, _ = closed_after(live_web, agent, lambda: Membership.objects.get(user=agent).delete())
    assert code == CLOSE_ACCESS_LOST


def test_a_move_to_another_tenant_closes_the_socket(live_web, agent, other_tenant):
    def change():
        membership = Membership.objects.get(user=agent)
        membership.tenant = other_tenant
        membership.save()

    assert closed_after(live_web, agent, change)[0] == CLOSE_ACCESS_LOST


def test_a_page_whose_session_ended_while_its_socket_was_away_goes_to_the_login(page, approver, live_web):
    """A refused handshake has no close code the script can read: the page
    asks itself whether the session holds, and goes to the login instead of
    reconnecting for ever. Its timers are the test's to move (Playwright's
    clock): the reconnect comes after the session has ended, never before."""
    page.clock.install()
    log_in(page, approver.username, PASSWORD)
    page.goto("/approvals/")
    page.wait_for_function("window.execgoLive && window.execgoLive.state === 'live'", polling=100)
    page.clock.pause_at(datetime.now(timezone.utc) + timedelta(seconds=5))
    page.evaluate("window.execgoLive.drop(); null")  # the socket goes away; its reconnect waits on the clock
    page.wait_for_function("window.execgoLive.state === 'reconnecting'", polling=100)
    Session.objects.all().delete()  # no signal: nothing tells the server, and it holds no socket to close

    page.clock.run_for(6000)

    page.wait_for_url(re.compile(r".*/accounts/login/\?next=%2Fapprovals%2F$"), timeout=BOUND_S * 1000)
    assert page.get_by_label("Username").is_visible()


def test_a_removal_from_the_approvers_closes_the_approvals_stream(live_web, tenant):
    carol = make_user("carol", tenant, groups=("approvers",))
    change = lambda: carol.groups.remove(Group.objects.get(name="approvers"))  # noqa: E731
    assert closed_after(live_web, carol, change, scope="approvals")[0] == CLOSE_ACCESS_LOST


def test_the_approvals_stream_is_for_approvers_only(live_web, agent):
    async def attempt():
        async with connect(ws_url(live_web, scope="approvals", after=0), additional_headers=headers(
                session_cookie(agent)), origin="http://127.0.0.1"):
            pass

    with pytest.raises(InvalidStatus) as refused:
        run_async(attempt())
    assert refused.value.response.status_code == 403


def test_another_users_change_leaves_the_socket_open(live_web, agent, tenant):
    bob = make_user("bob", tenant)

    async def stays_open() -> bool:
        async with connect(ws_url(live_web, scope="runs", after=0), additional_headers=headers(
                session_cookie(agent)), origin="http://127.0.0.1") as socket:
            await _ready(socket)
            await asyncio.to_thread(lambda: User.objects.filter(pk=bob.pk).update(is_active=False))
            try:
                await asyncio.wait_for(socket.recv(), QUIET_S)
            except TimeoutError:
                pass
            return socket.close_code is None

    assert run_async(stays_open())


def test_a_logout_closes_the_page_socket_and_the_page_goes_to_the_login(page, approver, live_web):
    log_in(page, approver.username, PASSWORD)
    page.goto("/approvals/")
    page.wait_for_function("window.execgoLive && window.execgoLive.state === 'live'")
    other = page.context.new_page()  # the same session, in another tab
    other.goto(f"{live_web.url}/approvals/")
    other.get_by_role("button", name="Log out").click()
    other.wait_for_url(re.compile(r".*/accounts/login/.*"))

    page.wait_for_url(re.compile(r".*/accounts/login/\?next=%2Fapprovals%2F$"), timeout=BOUND_S * 1000)
    assert page.evaluate("window.execgoLive === undefined || window.execgoLive.state !== 'live'")
    assert page.get_by_label("Username").is_visible()
    # Signed out, the login page stays where it is: no live script reconnects.
    page.wait_for_timeout(1500)
    assert "/accounts/login/" in page.url
