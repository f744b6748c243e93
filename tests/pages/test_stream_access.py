"""An agent's SSE stream (``runs/{id}/stream``) lasts only as long as what
let it open: revoking its token, deactivating its user or moving the user
to another tenant ends it with an ``access_lost`` event, within a generous
bound of the server's ``EXECGO_WS_RECHECK_S`` (1 s)."""

import threading
import time
import urllib.request

import pytest

from runs.models import Membership, Tenant
from runs.tokens import token_create, token_revoke
from tests.runs.admin_helpers import add_run

BOUND_S = 15


class Stream(threading.Thread):
    """Reads a stream to its end in the background, keeping its lines."""

    def __init__(self, url: str, key: str) -> None:
        super().__init__(daemon=True)
        self.request = urllib.request.Request(url, headers={"Authorization": f"Token {key}"})
        self.lines: list[str] = []
        self.opened = threading.Event()
        self.status = None

    def run(self) -> None:
        with urllib.request.urlopen(self.request, timeout=60) as response:
            self.status = response.status
            self.opened.set()
            for raw in response:
                self.lines.append(raw.decode().rstrip("\n"))


def open_stream(live_web, run, key: str) -> Stream:
    stream = Stream(f"{live_web.url}/api/v1/runs/{run.pk}/stream", key)
    stream.start()
    assert stream.opened.wait(BOUND_S) and stream.status == 200
    time.sleep(1.5)  # a check or more has passed with the credential still good
    assert stream.is_alive(), stream.lines
    return stream


def ended_by_access_lost(stream: Stream) -> bool:
    stream.join(BOUND_S)
    return not stream.is_alive() and "event: access_lost" in stream.lines


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("change", ["token revoked", "user deactivated", "user moved to another tenant"])
def test_a_stream_ends_when_its_credentials_stop_holding(live_web, tenant, agent, change):
    run = add_run(tenant, agent, "EXECUTING")  # never final: only lost access ends its stream
    token, key = token_create(user=agent, name="stream")
    stream = open_stream(live_web, run, key)

    if change == "token revoked":
        token_revoke(token=token)
    elif change == "user deactivated":
        agent.is_active = False
        agent.save(update_fields=["is_active"])
    else:
        Membership.objects.filter(user=agent).update(tenant=Tenant.objects.create(name="globex"))

    assert ended_by_access_lost(stream), stream.lines


@pytest.mark.django_db(transaction=True)
def test_another_tokens_revocation_leaves_a_stream_open(live_web, tenant, agent):
    run = add_run(tenant, agent, "EXECUTING")
    _, key = token_create(user=agent, name="stream")
    other, _ = token_create(user=agent, name="other")
    stream = open_stream(live_web, run, key)

    token_revoke(token=other)
    time.sleep(3)

    assert stream.is_alive() and "event: access_lost" not in stream.lines
    token_revoke(token=other.__class__.objects.get(name="stream"))
    assert ended_by_access_lost(stream)
