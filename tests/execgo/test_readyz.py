"""/healthz answers while the process lives; /readyz names each thing a run
needs (database, broker, channel layer, a live worker, beat) and answers
503 naming the one that fails. Failures are made without stopping anything
real: a broker on a port nobody listens on, no worker, beat never started.
The checks by name are the details an operator reads: these tests ask
with the metrics token (tests/execgo/test_operator_access.py: who else may, and
what an anonymous caller gets)."""

import json
import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from execgo.celery import app as celery_app
from execgo.health import SWEEP_TASK
from runtime import ledger
from tests.conftest import ROOT, _worker_env, free_port, log_tails, run_coroutine

pytestmark = pytest.mark.django_db

CHECKS = {"database", "broker", "channel_layer", "workers", "beat"}
OPERATOR_TOKEN = "operator-token-of-the-readyz-tests"


@pytest.fixture
def client(settings):
    settings.EXECGO_METRICS_TOKEN = OPERATOR_TOKEN
    return Client(headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"})



def sweeper_entry(*, last_run_at, every: int = 30) -> PeriodicTask:
    interval, _ = IntervalSchedule.objects.get_or_create(every=every, period=IntervalSchedule.SECONDS)
    return PeriodicTask.objects.create(name="sweep-zombie-runs", task=SWEEP_TASK, interval=interval,
                                       last_run_at=last_run_at)


def test_healthz_is_liveness_only(client):
    response = client.get("/healthz")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


def test_no_worker_is_not_ready(client):
    sweeper_entry(last_run_at=timezone.now())
    ready = client.get("/readyz")
    assert ready.status_code == 503
    checks = ready.json()["checks"]
    assert set(checks) == CHECKS
    assert checks["workers"].startswith("error: no worker answered a ping")
    assert {name for name, outcome in checks.items() if outcome != "ok"} == {"workers"}
    assert ready.json()["status"] == "unavailable"


@pytest.mark.django_db(transaction=True)
def test_beat_that_never_started_never_ran_or_stopped_is_not_ready(client, celery_worker, settings):
    settings.EXECGO_READYZ_TIMEOUT_S = 15  # the worker answers, loaded or not (the first answer ends the wait)

    def beat_check():
        ready = client.get("/readyz")
        assert ready.status_code == 503, ready.content
        checks = ready.json()["checks"]
        assert {name for name, outcome in checks.items() if outcome != "ok"} == {"beat"}, checks
        return checks["beat"]

    assert beat_check() == "error: the sweeper has no enabled beat entry: beat never started"
    entry = sweeper_entry(last_run_at=None)
    assert beat_check() == "error: beat never ran the sweeper"
    PeriodicTask.objects.filter(pk=entry.pk).update(last_run_at=timezone.now() - timedelta(seconds=61))
    assert beat_check() == "error: beat last ran the sweeper 61s ago (every 30s)"
    PeriodicTask.objects.filter(pk=entry.pk).update(enabled=False, last_run_at=timezone.now())
    assert beat_check().startswith("error: the sweeper has no enabled beat entry")


@pytest.mark.django_db(transaction=True)
def test_ready_with_a_real_worker_and_a_real_beat(client, celery_worker, tmp_path):
    ledger.host_register("probe-host")
    log_path = tmp_path / "beat.log"
    with open(log_path, "wb") as log:
        beat = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "execgo", "beat", "-l", "INFO", "--pidfile=",
             "-s", str(tmp_path / "beat-schedule")],
            cwd=ROOT, env={**_worker_env(), "EXECGO_SWEEP_INTERVAL_S": "2"}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while (ready := client.get("/readyz")).status_code != 200:
            if time.monotonic() > deadline or beat.poll() is not None:
                pytest.fail(f"{ready.content.decode()}\n{log_path.read_text()[-3000:]}{log_tails(celery_worker)}")
            time.sleep(0.5)
    finally:
        beat.terminate()
        beat.wait(timeout=30)
    body = ready.json()
    assert body["status"] == "ok"
    assert body["checks"] == dict.fromkeys(CHECKS, "ok")
    entry = PeriodicTask.objects.get(task=SWEEP_TASK)
    assert entry.last_run_at is not None and entry.interval.every == 2  # written by that beat
    [host] = [host for host in body["hosts"] if host["host"] == "probe-host"]
    assert set(host["capabilities"]) >= {"bubblewrap", "cgroup", "cpu", "memory", "pid_namespace"}


def test_broker_on_an_unused_port_is_not_ready_and_leaks_no_password(client, monkeypatch):
    sweeper_entry(last_run_at=timezone.now())
    url = f"redis://:hunter2-broker-password@127.0.0.1:{free_port()}/0"
    # Celery reads the environment variable before its own setting.
    monkeypatch.setenv("CELERY_BROKER_URL", url)
    monkeypatch.setitem(celery_app.conf, "broker_url", url)
    started = time.monotonic()
    ready = client.get("/readyz")
    assert time.monotonic() - started < 30
    assert ready.status_code == 503
    checks = ready.json()["checks"]
    assert checks["broker"].startswith("error: ") and checks["workers"].startswith("error: ")
    assert checks["database"] == checks["channel_layer"] == checks["beat"] == "ok"
    assert b"hunter2" not in ready.content


def test_channel_layer_on_an_unused_port_is_not_ready(client, settings):
    sweeper_entry(last_run_at=timezone.now())
    settings.CHANNEL_LAYERS = {**settings.CHANNEL_LAYERS, "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [f"redis://127.0.0.1:{free_port()}/0"]}}}
    ready = client.get("/readyz")
    assert ready.status_code == 503
    checks = ready.json()["checks"]
    assert checks["channel_layer"].startswith("error: ")
    assert checks["database"] == checks["broker"] == "ok"


READYZ_IN_A_PROCESS = """
import django
django.setup()
from django.test import Client
response = Client(headers={"Authorization": "Bearer process-operator-token"}).get("/readyz")
print(response.status_code)
print(response.content.decode())
"""


def test_database_on_an_unused_port_is_not_ready(tmp_path):
    env = {key: value for key, value in os.environ.items() if key not in {"CELERY_BROKER_URL", "REDIS_URL"}}
    env.update(DATABASE_URL=f"postgres://execgo:db-password-xyz@127.0.0.1:{free_port()}/execgo",
               EXECGO_DATA_DIR=str(tmp_path / "var"), DJANGO_SETTINGS_MODULE="execgo.settings",
               EXECGO_LOG_LEVEL="CRITICAL", EXECGO_METRICS_TOKEN="process-operator-token")
    done = subprocess.run([sys.executable, "-c", READYZ_IN_A_PROCESS], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    status, body = done.stdout.split("\n", 1)
    assert status == "503"
    body = json.loads(body)
    assert body["checks"]["database"] == "error: OperationalError"
    assert body["checks"]["broker"] == "ok"  # the filesystem broker of the embedded default
    assert "hosts" not in body
    assert "db-password-xyz" not in done.stdout + done.stderr


def test_the_channel_layer_check_works_in_a_thread_whose_event_loop_runs():
    """A synchronous caller inside a running event loop (a test that drives
    a browser calls the view so) still gets the check, not a RuntimeError."""
    from execgo import health

    async def called_synchronously_from_a_loop():
        return health._channel_layer()

    assert run_coroutine(called_synchronously_from_a_loop) == "ok"


def test_readiness_asked_often_stays_ready():
    """A channel layer keeps at most ``capacity`` unreceived messages a
    channel for a minute: a check that only sent, to one channel, was
    refused from its 101st ask within a minute on (a probe every 0.6 s or
    more often made a ready service not ready). The check leaves nothing
    behind."""
    from channels.layers import get_channel_layer

    from execgo import health

    asks = get_channel_layer().capacity + 20
    assert [health._channel_layer() for _ in range(asks)] == ["ok"] * asks
