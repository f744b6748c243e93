"""A short fault-injection run: a mixed workload meets a nemesis, and the
history checker judges what is left (tests/reliability/checker.py).

The workload, submitted over HTTP to a real web process with an
``Idempotency-Key`` each (a refused submit is sent again with its key):
chains of sequential steps, fan-outs (one step, three in parallel, one
after them), and long runs of which some are cancelled while they run. The
nemesis, between waves of submits: a pool process killed, every other
database connection terminated (PostgreSQL), the broker (a Redis of this
test's own) killed and started again empty, and the worker's whole process
group killed and the worker started again. Nothing is required to succeed;
everything accepted must end soundly.
"""

import os
import signal
import time

import psutil
import pytest
from django.conf import settings
from django.db import connection

from runs.models import Run
from runs.statemachine import FINAL
from tests.conftest import log_tails, wait_until
from tests.execgo.test_broker_outage import stack  # noqa: F401 (the fixture: own Redis, web, beat, worker)
from tests.reliability.checker import check_history

pytestmark = pytest.mark.django_db(transaction=True)

RUN_TIMEOUT_S = 60


def step(step_id: str, argv: list[str], *after: str) -> dict:
    return {"id": step_id, "tool": "shell", "params": {"argv": argv}, "depends_on": list(after)}


PLANS = {
    "chain": [step("a", ["sleep", "0.3"]), step("b", ["true"], "a"), step("c", ["sleep", "0.3"], "b")],
    "fan": [step("a", ["true"]), *(step(f"m{i}", ["sleep", "0.2"], "a") for i in range(3)),
            step("z", ["true"], "m0", "m1", "m2")],
    "long": [step("a", ["sleep", "4"])],
}


class Driver:
    """Submits the workload and records every answer."""

    def __init__(self, client):
        self.client, self.accepted, self.answers, self.pending = client, {}, [], []

    def submit(self, key: str) -> None:
        kind = ("chain", "fan", "long")[len(self.answers) % 3]
        response = self.client.post("/api/v1/runs", json={"title": f"{kind} {key}", "plan": {"steps": PLANS[kind]},
                                                          "timeout_s": RUN_TIMEOUT_S},
                                    headers={"Idempotency-Key": key})
        self.answers.append((key, response.status_code))
        if response.status_code in (200, 201):
            self.accepted[key] = (response.json()["id"], kind)
        else:
            assert response.status_code == 503 and response.json()["error"]["retryable"] is True, response.text
            self.pending.append(key)

    def wave(self, prefix: str, count: int) -> None:
        for index in range(count):
            self.submit(f"{prefix}-{index}")

    def retry_refused(self) -> None:
        pending, self.pending = self.pending, []
        for key in pending:
            self.submit(key)

    def cancel_long_runs(self, count: int) -> list[int]:
        cancelled = []
        for run_id, kind in list(self.accepted.values()):
            if kind == "long" and len(cancelled) < count:
                answer = self.client.post(f"/api/v1/runs/{run_id}/cancel", json={"reason": "nemesis"})
                assert answer.status_code in (202, 409), answer.text
                cancelled.append(run_id)
        return cancelled


def kill_a_pool_process(worker) -> None:
    children = psutil.Process(worker.proc.pid).children()
    if children:
        children[0].send_signal(signal.SIGKILL)


def terminate_other_connections() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                       "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        return cursor.fetchone()[0]


def test_a_mixed_workload_through_faults_keeps_a_sound_history(stack, tmp_path):  # noqa: F811
    redis, client, (web, beat, worker) = stack
    driver = Driver(client)
    try:
        driver.wave("first", 6)
        time.sleep(1.0)
        kill_a_pool_process(worker)
        driver.wave("second", 6)
        time.sleep(0.5)
        driver.cancel_long_runs(2)
        if not settings.IS_SQLITE:
            terminate_other_connections()
        driver.wave("third", 3)
        redis.kill()
        driver.wave("outage", 2)  # 201 (committed and relayed later) or 503 retryable (nothing committed)
        time.sleep(2.0)
        redis.start()  # empty
        driver.retry_refused()
        os.killpg(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait(timeout=30)
        worker.start()
        driver.wave("last", 3)
        driver.retry_refused()
        assert driver.pending == []

        run_ids = [run_id for run_id, _kind in driver.accepted.values()]
        wait_until(lambda: Run.objects.filter(pk__in=run_ids, state__in=FINAL).count() == len(run_ids),
                   timeout=RUN_TIMEOUT_S + 60, what="every accepted run final")
    except (AssertionError, pytest.fail.Exception) as exc:
        raise AssertionError(f"{exc}{log_tails(worker)}") from exc
    assert len(run_ids) == 20
    violations = check_history(run_ids, grace_s=30, export_dir=tmp_path)
    assert violations == [], violations
    states = dict(Run.objects.filter(pk__in=run_ids).values_list("pk", "state"))
    print(f"\n{len(run_ids)} runs through the faults: "
          f"{ {state: list(states.values()).count(state) for state in set(states.values())} }")
