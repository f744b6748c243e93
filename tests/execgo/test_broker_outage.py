"""A broker outage loses nothing: with the broker (a Redis of this test's
own) killed while runs are queued and submits go on, and restarted empty,
every submit is answered 201 (and its run later SUCCEEDED) or 503 retryable
(and nothing committed); an idempotent retry answers the run that will
run; the queued runs whose messages died with the broker are sent again,
never failed; and the dispatch outbox ends empty."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psycopg
import pytest
from django.db import connection

from runs.models import AuditLog, Dispatch, Run
from tests.conftest import ROOT, WorkerProcess, _worker_env, free_port, log_tails, make_token, wait_until
from tests.reliability.checker import check_history

pytestmark = pytest.mark.django_db(transaction=True)

FINAL = {"SUCCEEDED", "CLOSED_FAILED", "CLOSED_REJECTED", "CLOSED_CANCELLED"}
PLAN = {"steps": [{"id": "nap", "tool": "shell", "params": {"argv": ["sleep", "0.3"]}}]}
# The sweeper and the relay tick every second; a run whose message was lost is sent again after 3 s.
FAST = {"EXECGO_SWEEP_INTERVAL_S": "1", "EXECGO_DISPATCH_RELAY_INTERVAL_S": "1",
        **{f"EXECGO_ZOMBIE_{state}_S": "3" for state in ("CREATED", "PREPARING", "POLICY_CHECK", "TRACING",
                                                          "TRANSIENT", "EXECUTING_IDLE")}}



class Redis:
    """A redis-server of this test's own on a free port, that keeps nothing."""

    def __init__(self, tmp_path: Path):
        self.port, self.dir, self.proc = free_port(), tmp_path, None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.dir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 20
        while subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True,
                             text=True).stdout.strip() != "PONG":
            if time.monotonic() > deadline:
                pytest.fail("redis-server did not start")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Service:
    """A web or beat process of the Procfile against the test database and ``env``."""

    def __init__(self, name: str, argv: list[str], env: dict, tmp_path: Path):
        self.log_path = tmp_path / f"{name}.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env={**_worker_env(), **env}, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


@pytest.fixture
def stack(tmp_path, agent):
    redis = Redis(tmp_path)
    redis.start()
    env = {"CELERY_BROKER_URL": redis.url, **FAST}
    port = free_port()
    web = Service("web", [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "--access-log",
                          "/dev/null", "execgo.asgi:application"], env, tmp_path)
    beat = Service("beat", [sys.executable, "-m", "celery", "-A", "execgo", "beat", "-l", "INFO",
                            "--schedule", str(tmp_path / "beat-schedule")], env, tmp_path)
    worker = WorkerProcess(hostname="outage", env=env)
    try:
        worker.start()
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30,
                              headers={"Authorization": f"Token {make_token(agent)}"})
        wait_until(lambda: _answers(client), timeout=60, what="the web process answering")
        yield redis, client, (web, beat, worker)
        client.close()
    finally:
        worker.stop()
        beat.stop()
        web.stop()
        redis.kill()


def _answers(client: httpx.Client) -> bool:
    try:
        return client.get("/healthz").status_code == 200
    except httpx.TransportError:
        return False


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
    for n in range(6):
        record(f"during-{n}", submit(client, f"during-{n}"))
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
