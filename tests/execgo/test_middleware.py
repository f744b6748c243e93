"""Django's middleware as ExecGo serves it under ASGI (execgo/middleware.py):
the hooks that only read or set headers run on the event loop, and the
ones that may reach the database (the messages' store) still run in the
thread, so sign-in, CSRF and messages behave as before."""

import re

import pytest
from asgiref import sync as asgiref_sync
from django.test import AsyncClient

from runs.models import AuditLog
from tests.conftest import make_token, make_user, run_coroutine
from tests.pages.test_pages_run_actions import csrf_token_of_form

pytestmark = pytest.mark.django_db(transaction=True)

ON_THE_LOOP = {
    "CommonMiddleware.process_request", "CommonMiddleware.process_response",
    "AuthenticationMiddleware.process_request",
    "MessageMiddleware.process_request", "MessageMiddleware.process_response",
    "RequestContextMiddleware.process_view", "_login_delay",
}


@pytest.fixture
def trips(monkeypatch) -> list[str]:
    """The functions run through ``sync_to_async`` (each a trip to the thread)."""
    calls: list[str] = []
    real_call = asgiref_sync.SyncToAsync.__call__

    async def counted(self, *args, **kwargs):
        calls.append(getattr(self.func, "__qualname__", repr(self.func)))
        return await real_call(self, *args, **kwargs)

    monkeypatch.setattr(asgiref_sync.SyncToAsync, "__call__", counted)
    return calls


def test_an_api_read_keeps_the_header_hooks_on_the_event_loop(agent, trips):
    key = make_token(agent)

    async def read():
        return await AsyncClient().get("/api/v1/runs/999999", headers={"Authorization": f"Token {key}"})

    response = run_coroutine(read)

    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
    assert response["X-Frame-Options"] == "DENY" and response["X-Content-Type-Options"] == "nosniff"
    assert int(response["Content-Length"]) == len(response.content)
    assert not ON_THE_LOOP & set(trips), trips
    assert "View.as_view.<locals>.view" in trips  # the view itself still runs in the thread


def test_a_sign_in_a_cancel_and_its_message_through_asgi(tenant, make_run, trips):
    user = make_user("alice", tenant, groups=("approvers",))
    run = make_run("AWAITING_HITL")
    client = AsyncClient(enforce_csrf_checks=True)

    async def scenario():
        login = await client.get("/accounts/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', login.content.decode())[1]
        signed_in = await client.post("/accounts/login/", {
            "username": "alice", "password": "pw-alice", "csrfmiddlewaretoken": token})
        assert signed_in.status_code == 302, signed_in.content.decode()[-2000:]
        assert client.cookies["sessionid"].value
        page = await client.get(f"/runs/{run.pk}/")
        assert page.status_code == 200
        token = csrf_token_of_form(page.content.decode(), f"/runs/{run.pk}/cancel")
        refused = await client.post(f"/runs/{run.pk}/cancel", {"csrfmiddlewaretoken": "x" * 64})
        assert refused.status_code == 403
        cancelled = await client.post(f"/runs/{run.pk}/cancel", {"csrfmiddlewaretoken": token})
        assert (cancelled.status_code, cancelled["Location"]) == (302, f"/runs/{run.pk}/")
        return (await client.get(cancelled["Location"])).content.decode()

    after = run_coroutine(scenario)

    assert f"Cancel requested for run {run.pk}." in after
    assert AuditLog.objects.filter(run_id=run.pk, event="cancel_requested", actor=user).count() == 1
    # The messages were used: their store went to the thread.
    assert "MessageMiddleware.process_response" in trips
