"""What strangers get from /readyz and /metrics: whether the service is
ready, and nothing else. The checks by name and the hosts (kernel, uid,
sandbox tools) are for the metrics token and staff users; the figures of
/metrics are for the scraper's bearer token only. Assertions are on the
bytes: no host name, kernel release, tenant name or metric in what a
stranger reads."""

import json
import platform
import socket

import pytest
from django.test import Client
from django.utils import timezone

from runtime import ledger
from tests.conftest import make_user, token_client
from tests.execgo.test_readyz import sweeper_entry

pytestmark = pytest.mark.django_db

TOKEN = "the-scrapers-token-0123456789abcdef"


@pytest.fixture
def configured(settings, tenant, make_run):
    """A token set, a host registered (kernel and all), a run of tenant acme."""
    settings.EXECGO_METRICS_TOKEN = TOKEN
    settings.EXECGO_METRICS_PUBLIC = False
    ledger.host_register(socket.gethostname())
    sweeper_entry(last_run_at=timezone.now())
    make_run("SUCCEEDED", closing_cause="succeeded")
    return settings


def host_details() -> list[bytes]:
    return [socket.gethostname().encode(), platform.release().encode(), b"bubblewrap", b"euid", b"kernel",
            b"pasta", b"capabilities", b"hosts"]


def assert_says_nothing(body: bytes, tenant_name: str) -> None:
    for detail in host_details():
        assert detail not in body, detail
    assert tenant_name.encode() not in body
    assert b"execgo_" not in body
    assert b"checks" not in body and b"workers" not in body and b"broker" not in body


def test_an_anonymous_readyz_says_only_not_ready(configured, client, tenant):
    response = client.get("/readyz")  # no worker runs: not ready
    assert response.status_code == 503
    assert json.loads(response.content) == {"status": "not ready"}
    assert_says_nothing(response.content, tenant.name)


@pytest.mark.django_db(transaction=True)
def test_an_anonymous_readyz_says_only_ready(configured, client, tenant, celery_worker, settings):
    # What the body says is the point here, not how fast a loaded worker answers a ping (the
    # first answer ends the wait).
    settings.EXECGO_READYZ_TIMEOUT_S = 15
    response = client.get("/readyz")
    why = Client(headers={"Authorization": f"Bearer {TOKEN}"}).get("/readyz").content  # the checks by name
    assert (response.status_code, json.loads(response.content)) == (200, {"status": "ready"}), why
    assert_says_nothing(response.content, tenant.name)


@pytest.mark.parametrize("authorization", [
    "", "Bearer", "Bearer ", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", f"Token {TOKEN}", f"Basic {TOKEN}",
    "Bearer \u00e9t\u00e9", "Token 0123456789abcdef0123456789abcdef01234567", "Token \x00",
])
def test_a_wrong_credential_gets_the_anonymous_readyz(configured, tenant, authorization):
    response = Client(headers={"Authorization": authorization} if authorization else {}).get("/readyz")
    assert response.status_code == 503
    assert json.loads(response.content) == {"status": "not ready"}


def details_of(response) -> dict:
    body = json.loads(response.content)
    assert body["status"] == "unavailable"
    assert set(body["checks"]) == {"database", "broker", "channel_layer", "workers", "beat"}
    assert body["checks"]["workers"].startswith("error: no worker answered")
    assert socket.gethostname() in {host["host"] for host in body["hosts"]}
    assert platform.release().encode() in response.content  # the kernel, in the capabilities
    return body


def test_the_metrics_token_gets_the_details(configured):
    details_of(Client(headers={"Authorization": f"Bearer {TOKEN}"}).get("/readyz"))
    details_of(Client(headers={"Authorization": f"bearer  {TOKEN} "}).get("/readyz"))


def test_a_staff_session_or_a_staff_token_gets_the_details(configured, tenant):
    staff = make_user("operator", tenant)
    staff.is_staff = True
    staff.save()
    session = Client()
    session.force_login(staff)
    details_of(session.get("/readyz"))
    details_of(token_client(staff).get("/readyz"))


def test_a_member_who_is_not_staff_gets_no_details(configured, tenant, agent):
    for caller in (token_client(agent), Client()):
        if isinstance(caller, Client) and not caller.session.session_key:
            caller.force_login(agent)
        assert json.loads(caller.get("/readyz").content) == {"status": "not ready"}


def test_a_deactivated_staff_user_gets_no_details(configured, tenant):
    staff = make_user("former-operator", tenant)
    staff.is_staff = True
    staff.save()
    api = token_client(staff)
    staff.is_active = False
    staff.save()
    assert json.loads(api.get("/readyz").content) == {"status": "not ready"}


# --- /metrics --------------------------------------------------------------------

def test_metrics_answer_the_token(configured):
    response = Client(headers={"Authorization": f"Bearer {TOKEN}"}).get("/metrics")
    assert response.status_code == 200
    assert b"# TYPE execgo_runs gauge" in response.content


@pytest.mark.parametrize("authorization", [
    None, "Bearer", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", f"Token {TOKEN}", f"Basic {TOKEN}", TOKEN,
    "Bearer \u00e9t\u00e9", "Bearer \x00",
])
def test_metrics_refuse_a_missing_or_wrong_token(configured, tenant, authorization):
    client = Client(headers={"Authorization": authorization} if authorization is not None else {})
    response = client.get("/metrics")
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")
    assert json.loads(response.content)["error"]["code"] == "denied"
    assert_says_nothing(response.content, tenant.name)


def test_metrics_are_not_for_a_staff_session(configured, tenant):
    staff = make_user("operator", tenant)
    staff.is_staff = True
    staff.save()
    session = Client()
    session.force_login(staff)
    assert session.get("/metrics").status_code == 401


def test_with_no_token_metrics_answer_no_one_unless_made_public(configured, tenant):
    configured.EXECGO_METRICS_TOKEN = ""
    refused = Client(headers={"Authorization": "Bearer "}).get("/metrics")
    assert refused.status_code == 401
    assert_says_nothing(refused.content, tenant.name)
    assert Client(headers={"Authorization": f"Bearer {TOKEN}"}).get("/metrics").status_code == 401

    configured.EXECGO_METRICS_PUBLIC = True
    public = Client().get("/metrics")
    assert public.status_code == 200 and b"execgo_runs" in public.content
    assert tenant.name.encode() not in public.content  # no metric names a tenant
    # /readyz's details are not opened by it: that needs the token or staff.
    assert json.loads(Client().get("/readyz").content) == {"status": "not ready"}


def test_a_token_set_wins_over_public(configured):
    configured.EXECGO_METRICS_PUBLIC = True
    assert Client().get("/metrics").status_code == 401
