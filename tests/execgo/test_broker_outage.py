"""A broker outage loses nothing: with the broker (a Redis of this test's
own) killed while runs are queued and submits go on, and restarted empty,
every submit is answered 201 (and its run later SUCCEEDED) or 503 retryable
(and nothing committed); an idempotent retry answers the run that will
run; the queued runs whose messages died with the broker are sent again,
never failed; and the dispatch outbox ends empty."""

import time

import httpx
import psycopg
import pytest
from django.db import connection

from runs.models import AuditLog, Dispatch, Run
from tests.conftest import log_tails, wait_until
from tests.reliability.checker import check_history
from tests.reliability.stack import running_stack

pytestmark = pytest.mark.django_db(transaction=True)

FINAL = {"SUCCEEDED", "CLOSED_FAILED", "CLOSED_REJECTED", "CLOSED_CANCELLED"}
PLAN = {"steps": [{"id": "nap", "tool": "shell", "params": {"argv": ["sleep", "0.3"]}}]}


@pytest.fixture
def stack(tmp_path, agent):
    """The sweeper and the relay tick every second; a run whose message was lost is sent again after 3 s."""
    with running_stack(tmp_path, agent) as started:
        yield started


def submit(client: httpx.Client, key: str) -> httpx.Response:
    return client.post("/api/v1/runs", json={"title": key, "plan": PLAN}, headers={"Idempotency-Key": key})


def test_a_broker_killed_and_restarted_empty_loses_no_run(stack, tmp_path):
    redis, client, processes = stack
    accepted: dict[str, int] = {}
    refused = []

    def record(key: str, response: httpx.Response) -> None:
        if response.status_code == 201:
            accepted[key] = response.json()["id"]
        else:
            # Refused: retryable, said so, and nothing committed under its key.
            assert response.status_code == 503, response.text
            body = response.json()["error"]
            assert body["retryable"] is True and int(response.headers["Retry-After"]) >= 1
            refused.append(key)

    for n in range(12):  # more than a -c 2 worker takes at once: a queue in the broker
        record(f"before-{n}", submit(client, f"before-{n}"))
    assert len(accepted) == 12

    redis.kill()  # the queue dies with it
    answered_in = []
    for n in range(6):  # one a second, over the outage
        asked = time.monotonic()
        record(f"during-{n}", submit(client, f"during-{n}"))
        answered_in.append(time.monotonic() - asked)
        time.sleep(1)
    # Answered at once: the web process does not wait for the broker to come back
    # (kombu's default reconnect retries made each submit take about 6 s).
    assert max(answered_in) < 3, answered_in
    # An idempotent retry during the outage answers the same run, which will run.
    if "during-0" in accepted:
        again = submit(client, "during-0")
        assert again.status_code == 200 and again.json()["id"] == accepted["during-0"]
    during = [accepted[key] for key in accepted if key.startswith("during-")]
    kept = [row.args for row in Dispatch.objects.filter(task="runs.tasks.advance_run")]
    assert sorted(args[0] for args in kept if args[0] in during) == sorted(during)
    time.sleep(3)

    redis.start()  # empty
    for n in range(4):
        record(f"after-{n}", submit(client, f"after-{n}"))

    def all_final() -> bool:
        return Run.objects.filter(pk__in=accepted.values(), state__in=FINAL).count() == len(accepted)

    try:
        wait_until(all_final, timeout=120, what="every accepted run final")
    except BaseException:
        print(log_tails(*[processes[2]]), *(p.log_path.read_text()[-3000:] for p in processes[:2]))
        raise
    states = dict(Run.objects.filter(pk__in=accepted.values()).values_list("pk", "state"))
    assert set(states.values()) == {"SUCCEEDED"}, states
    assert not Run.objects.filter(idempotency_key__in=refused).exists()
    assert len(accepted) + len(refused) == 22
    # The runs queued in the dead broker were sent again by the sweeper; the
    # submits it refused were relayed from the outbox, which is now empty.
    assert AuditLog.objects.filter(event="work_resent", run_id__in=accepted.values()).exists()
    assert not Dispatch.objects.exists()
    assert check_history(list(accepted.values()), export_dir=tmp_path) == []


@pytest.mark.skipif(connection.vendor != "postgresql", reason="a lock timeout of PostgreSQL's")
def test_a_submit_the_store_cannot_take_is_a_retryable_503_that_commits_nothing(api):
    """The other branch of the contract: a database that cannot take the run
    (here: the runs table locked by another session, and a lock timeout)
    answers 503 retryable with Retry-After, and no run, job or outbox row
    is left behind."""
    db = connection.settings_dict
    other = psycopg.connect(host=db["HOST"] or "127.0.0.1", port=db["PORT"] or 5432, user=db["USER"] or "postgres",
                            dbname=db["NAME"])
    runs, dispatches = Run.objects.count(), Dispatch.objects.count()
    try:
        other.execute("LOCK TABLE runs_run IN ACCESS EXCLUSIVE MODE")
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '300ms'")
        response = api.post("/api/v1/runs", {"title": "locked out", "plan": PLAN}, format="json",
                            HTTP_IDEMPOTENCY_KEY="locked-out")
    finally:
        other.rollback()
        other.close()
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = 0")
    assert response.status_code == 503, response.content
    error = response.json()["error"]
    assert error["retryable"] is True and error["source"] == "store"
    assert int(response["Retry-After"]) >= 1
    assert (Run.objects.count(), Dispatch.objects.count()) == (runs, dispatches)
    assert not Run.objects.filter(idempotency_key="locked-out").exists()
