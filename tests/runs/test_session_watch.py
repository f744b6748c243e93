"""The session watch of a web process (runs/sessions.py), driven in this
process on its own event loop: its periodic check of every socket keeps its
clock however often the watch is woken for other users, and a failed check
does not end the watch. (Its work against a live server, socket by socket,
is in tests/pages/test_live_session_end.py.)"""

import asyncio

import pytest
from channels.layers import get_channel_layer
from django.contrib.sessions.models import Session

from runs.relay import RELAY_LAYER
from runs.sessions import CLOSE_SESSION_ENDED, SessionWatch, grant_for
from tests.pages.conftest import session_cookie
from tests.pages.test_live_relay import run_async

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.stack_free]

BOUND_S = 10.0  # generous: the check is due every EXECGO_WS_RECHECK_S


def test_the_periodic_check_keeps_its_clock_when_the_watch_is_woken_more_often(agent, tenant, settings):
    settings.EXECGO_WS_RECHECK_S = 0.5
    key = session_cookie(agent)
    grant = grant_for(agent, key, tenant_id=tenant.pk, needs_approver=False)
    watch = SessionWatch()

    async def scenario() -> dict:
        """The session ended the way no signal announces, and the watch woken
        every 0.1 s for nobody's user id (a wake that checks no socket)."""
        layer = get_channel_layer(RELAY_LAYER)
        channel = await layer.new_channel("test-watch.")
        await watch.ensure_started()
        watch.register(channel, grant)
        await asyncio.to_thread(lambda: Session.objects.filter(session_key=key).delete())

        async def nudge() -> None:
            while True:
                watch.told([0])
                await asyncio.sleep(0.1)

        nudger = asyncio.create_task(nudge())
        try:
            return await asyncio.wait_for(layer.receive(channel), BOUND_S)
        finally:
            for task in [nudger, *watch._tasks]:
                task.cancel()

    message = run_async(scenario())

    assert message == {"type": "session.end", "code": CLOSE_SESSION_ENDED}
    assert watch.grants == {}


def test_a_socket_whose_channel_is_full_is_ended_once_it_drains(agent, tenant, settings):
    """A socket's consumer behind on its messages: the watch's message to end
    it does not fit, the grant stays, the watch goes on, and a later check
    ends the socket."""
    settings.EXECGO_WS_RECHECK_S = 0.2
    key = session_cookie(agent)
    grant = grant_for(agent, key, tenant_id=tenant.pk, needs_approver=False)
    watch = SessionWatch()

    async def scenario() -> list[dict]:
        layer = get_channel_layer(RELAY_LAYER)
        channel = await layer.new_channel("test-watch.")
        for n in range(layer.capacity):
            await layer.send(channel, {"type": "relay.event", "n": n})
        await watch.ensure_started()
        watch.register(channel, grant)
        await asyncio.to_thread(lambda: Session.objects.filter(session_key=key).delete())
        try:
            deadline = asyncio.get_running_loop().time() + BOUND_S
            while watch.checks < 3:  # the session's end seen, and the channel still full
                assert asyncio.get_running_loop().time() < deadline, "the watch stopped checking"
                await asyncio.sleep(0.05)
            assert channel in watch.grants
            return [await asyncio.wait_for(layer.receive(channel), BOUND_S) for _ in range(layer.capacity + 1)]
        finally:
            for task in watch._tasks:
                task.cancel()

    received = run_async(scenario())

    assert [message.get("n") for message in received[:-1]] == list(range(get_channel_layer(RELAY_LAYER).capacity))
    assert received[-1] == {"type": "session.end", "code": CLOSE_SESSION_ENDED}
    assert watch.grants == {}
