"""The live relay end to end: a real worker writes events, a live Daphne
server relays them over websockets; a client that drops and resumes from
its last event id ends with exactly the server's event list, and nobody
hears another tenant's events."""

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from runs.models import Event, EventType, Run
from runs.statemachine import FINAL
from tests.conftest import make_user, simple_plan, token_client, wait_for_run
from tests.pages.conftest import session_cookie

pytestmark = pytest.mark.django_db(transaction=True)

STEP_SLEEP = ["sleep", "0.25"]


def run_async(coroutine):
    """``asyncio.run`` in a thread of its own: Playwright's sync API (the
    page tests, in this same process) keeps an event loop in this one."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def ws_url(server, **params) -> str:
    query = "&".join(f"{key}={value}" for key, value in params.items())
    return f"ws://127.0.0.1:{server.port}/ws/live/?{query}"


def headers(cookie: str | None) -> dict:
    return {"Cookie": f"sessionid={cookie}"} if cookie else {}


async def receive(url: str, cookie: str, *, until, timeout: float, stop_after: int | None = None) -> list[dict]:
    """Events received on one connection until ``until(event)`` holds (or
    ``stop_after`` events, or the timeout)."""
    events: list[dict] = []
    deadline = time.monotonic() + timeout
    async with connect(url, additional_headers=headers(cookie), origin="http://127.0.0.1") as socket:
        while time.monotonic() < deadline:
            try:
                message = json.loads(await asyncio.wait_for(socket.recv(), deadline - time.monotonic()))
            except TimeoutError:
                break
            if message["type"] != "event":
                continue
            events.append(message["event"])
            if until(message["event"]) or (stop_after is not None and len(events) >= stop_after):
                break
    return events


def ended(event: dict) -> bool:
    return event["type"] == EventType.RUN_STATE_CHANGED and event["data"]["to"] in FINAL


def submit(agent, steps: int) -> int:
    response = token_client(agent).post("/api/v1/runs", {"plan": simple_plan(*[STEP_SLEEP] * steps)}, format="json")
    assert response.status_code == 201, response.content
    return response.json()["id"]


def test_a_dropped_client_resumes_with_no_gap_and_no_duplicate(live_web, celery_worker, agent):
    cookie = session_cookie(agent)
    run_id = submit(agent, steps=6)

    async def drop_and_resume() -> tuple[list[dict], list[dict]]:
        first = await receive(ws_url(live_web, scope="run", run=run_id, after=0), cookie, until=ended, timeout=30,
                              stop_after=6)
        await asyncio.sleep(0.8)  # events keep coming while the client is away
        second = await receive(ws_url(live_web, scope="run", run=run_id, after=first[-1]["id"]), cookie,
                               until=ended, timeout=60)
        return first, second

    first, second = run_async(drop_and_resume())

    assert wait_for_run(run_id).state == "SUCCEEDED"
    received = [event["id"] for event in first + second]
    server = list(Event.objects.filter(run_id=run_id).order_by("id").values_list("id", flat=True))
    assert len(first) == 6 and second, "the client dropped mid-run and resumed"
    assert received == server  # every event once, in order
    assert second[0]["id"] > first[-1]["id"]


def test_the_runs_scope_resumes_too(live_web, celery_worker, agent, tenant):
    cookie = session_cookie(agent)
    after = Event.objects.order_by("-id").values_list("id", flat=True).first() or 0
    run_ids = [submit(agent, steps=2) for _ in range(3)]

    async def drop_and_resume() -> list[dict]:
        first = await receive(ws_url(live_web, scope="runs", after=after), cookie, until=lambda e: False,
                              timeout=30, stop_after=5)
        await asyncio.sleep(0.5)
        remaining = set(run_ids)

        def all_ended(event):
            if ended(event):
                remaining.discard(event["run_id"])
            return not remaining

        for event in first:
            all_ended(event)
        second = await receive(ws_url(live_web, scope="runs", after=first[-1]["id"]), cookie, until=all_ended,
                               timeout=60)
        return first + second

    received = run_async(drop_and_resume())

    server = list(Event.objects.filter(run__tenant=tenant, type=EventType.RUN_STATE_CHANGED, id__gt=after)
                  .order_by("id").values_list("id", flat=True))
    assert [event["id"] for event in received] == server
    assert {event["run_id"] for event in received} == set(run_ids)


def test_another_tenant_hears_nothing_and_cannot_subscribe(live_web, celery_worker, agent, other_tenant):
    outsider = make_user("outsider", other_tenant)
    outsider_cookie = session_cookie(outsider)
    after = Event.objects.order_by("-id").values_list("id", flat=True).first() or 0
    run_id = submit(agent, steps=3)

    heard = run_async(receive(ws_url(live_web, scope="runs", after=after), outsider_cookie,
                                until=lambda e: False, timeout=4))
    assert wait_for_run(run_id).state == "SUCCEEDED"
    assert heard == []
    assert Event.objects.filter(run_id=run_id).count() > 5  # there was plenty to hear

    for url, cookie in [
        (ws_url(live_web, scope="run", run=run_id, after=0), outsider_cookie),  # another tenant's run
        (ws_url(live_web, scope="runs", after=0), None),  # anonymous
        (ws_url(live_web, scope="nonsense", after=0), session_cookie(agent)),
    ]:
        with pytest.raises(InvalidStatus) as refused:
            run_async(receive(url, cookie, until=lambda e: True, timeout=5))
        assert refused.value.response.status_code == 403


def test_a_cross_site_origin_is_refused(live_web, agent):
    async def from_evil_site():
        async with connect(ws_url(live_web, scope="runs", after=0), additional_headers=headers(session_cookie(agent)),
                           origin="http://evil.example"):
            pass

    with pytest.raises(InvalidStatus) as refused:
        run_async(from_evil_site())
    assert refused.value.response.status_code == 403


def test_a_run_page_backlog_is_the_runs_events(live_web, agent, make_run):
    """Connecting late with after=0 sends the whole history of the run."""
    run = make_run("SUCCEEDED", closing_cause="succeeded")
    Event.objects.bulk_create(Event(type=EventType.TASK_PROGRESSED, run=run, timestamp=run.created_at,
                                    message=f"line {n}") for n in range(5))
    events = run_async(receive(ws_url(live_web, scope="run", run=run.pk, after=0), session_cookie(agent),
                                 until=lambda e: False, timeout=2))
    assert [event["message"] for event in events] == [f"line {n}" for n in range(5)]
    assert Run.objects.get(pk=run.pk).state == "SUCCEEDED"


def test_a_session_a_decision_link_opened_gets_no_live_stream(live_web, agent, tenant):
    """EXECGO_DECISION_LINK_SIGN_IN: such a session is good for its link's page only."""
    from django.contrib.sessions.backends.db import SessionStore

    from execgo.middleware import LINK_ONLY_SESSION_KEY
    from tests.conftest import make_user

    approver = make_user("linked", tenant, groups=("approvers",))
    cookie = session_cookie(approver)
    store = SessionStore(session_key=cookie)
    store[LINK_ONLY_SESSION_KEY] = "/approvals/link/x/"
    store.save()
    for scope in ("runs", "approvals"):
        with pytest.raises(InvalidStatus) as refused:
            run_async(receive(ws_url(live_web, scope=scope, after=0), cookie, until=lambda e: True, timeout=5))
        assert refused.value.response.status_code == 403
    del store[LINK_ONLY_SESSION_KEY]
    store.save()
    heard = run_async(receive(ws_url(live_web, scope="approvals", after=0), cookie, until=lambda e: False, timeout=2))
    assert heard == []  # the same session without the mark connects (and hears nothing here)
