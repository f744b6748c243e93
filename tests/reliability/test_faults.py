"""Fault injection: a mixed workload meets a nemesis, and the history
checker judges what is left (tests/reliability/checker.py).

The workload (tests/reliability/workload.py), submitted over HTTP to a real
web process with an ``Idempotency-Key`` each: chains, fan-outs, long runs
of which some are cancelled while they run, and runs whose http step (a
side effect the loopback recorder counts) waits for a scripted approver,
who decides over HTTP too. The nemesis, between waves of submits, in each
round: a pool process killed; every other database connection terminated
(PostgreSQL); the worker's whole process group stopped (SIGSTOP) past the
sweeper's thresholds, so its work is sent again while it is frozen, then
let go on; the broker (a Redis of this test's own) killed, submits sent
during the outage, and started again empty; the worker's whole process
group killed and the worker started again. Nothing is required to
succeed; everything accepted must end soundly, and no side effect may
happen more often than its step was started.

One round runs in ``make test``; ``EXECGO_FAULT_ROUNDS=N`` runs N rounds
(docs/reliability.md).
"""

import os
import signal
import time

import httpx
import psutil
import pytest
from django.conf import settings
from django.db import connection

from runs.models import Run
from runs.statemachine import FINAL
from tests.conftest import log_tails, make_token, make_user, wait_until
from tests.reliability.checker import check_history
from tests.reliability.recorder import EffectRecorder
from tests.reliability.stack import running_stack
from tests.reliability.workload import RUN_TIMEOUT_S, Driver, ScriptedApprover

pytestmark = pytest.mark.django_db(transaction=True)

ROUNDS = int(os.environ.get("EXECGO_FAULT_ROUNDS", "1"))
FROZEN_S = 8  # past the sweeper's 3 s thresholds and its 1 s tick, twice over


def kill_a_pool_process(worker) -> None:
    children = psutil.Process(worker.proc.pid).children()
    if children:
        children[0].send_signal(signal.SIGKILL)


def terminate_other_connections() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                       "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        return cursor.fetchone()[0]


def freeze(worker, driver: Driver, round_: int) -> None:
    """Stop the worker's process group; submits go on meanwhile."""
    os.killpg(worker.proc.pid, signal.SIGSTOP)
    try:
        driver.wave(f"frozen{round_}", 3)
        time.sleep(FROZEN_S)
    finally:
        os.killpg(worker.proc.pid, signal.SIGCONT)


def one_round(round_: int, driver: Driver, redis, worker) -> None:
    driver.wave(f"first{round_}", 6)
    time.sleep(1.0)
    kill_a_pool_process(worker)
    driver.wave(f"second{round_}", 6)
    time.sleep(0.5)
    driver.cancel_long_runs(2 * round_)
    if not settings.IS_SQLITE:
        terminate_other_connections()
    driver.wave(f"third{round_}", 3)
    freeze(worker, driver, round_)
    redis.kill()
    driver.wave(f"outage{round_}", 2)  # 201 (committed and relayed later) or 503 retryable (nothing committed)
    time.sleep(2.0)
    redis.start()  # empty
    driver.retry_refused()
    os.killpg(worker.proc.pid, signal.SIGKILL)
    worker.proc.wait(timeout=30)
    worker.log.close()
    worker.start()
    driver.wave(f"last{round_}", 4)
    driver.retry_refused()


@pytest.fixture
def recorder():
    with EffectRecorder() as started:
        yield started


@pytest.fixture
def stack(tmp_path, agent, recorder):
    with running_stack(tmp_path, agent, {"EXECGO_HTTP_ALLOWED_NETWORKS": recorder.network}) as started:
        yield started


def test_a_mixed_workload_through_faults_keeps_a_sound_history(stack, recorder, tenant, tmp_path):
    redis, client, (web, beat, worker) = stack
    driver = Driver(client, recorder)
    person = make_user("ann", tenant, groups=("approvers",))
    approver = ScriptedApprover(httpx.Client(base_url=client.base_url, timeout=30,
                                             headers={"Authorization": f"Token {make_token(person)}"}))
    approver.start()
    try:
        for round_ in range(1, ROUNDS + 1):
            one_round(round_, driver, redis, worker)
        assert driver.pending == []
        run_ids = driver.run_ids
        wait_until(lambda: Run.objects.filter(pk__in=run_ids, state__in=FINAL).count() == len(run_ids),
                   timeout=RUN_TIMEOUT_S + 60, what="every accepted run final")
    except (AssertionError, pytest.fail.Exception) as exc:
        raise AssertionError(f"{exc}{log_tails(worker)}") from exc
    finally:
        approver.stop()
    assert len(run_ids) == 24 * ROUNDS
    effects = driver.side_effects()
    violations = check_history(run_ids, grace_s=30, export_dir=tmp_path, side_effects=effects)
    assert violations == [], violations
    # The approver was answered, never failed: a stale view or an outage is said so and tried again.
    assert {code for *_request, code in approver.answers} <= {200, 409, 503}, approver.answers
    assert "approve" in approver.decided.values() and "reject" in approver.decided.values(), approver.decided

    states = list(Run.objects.filter(pk__in=run_ids).values_list("state", flat=True))
    print(f"\n{len(run_ids)} runs through {ROUNDS} round(s) of faults: "
          f"{ {state: states.count(state) for state in sorted(set(states))} }; "
          f"{len(approver.decided)} approval requests decided "
          f"({list(approver.decided.values()).count('reject')} rejected); "
          f"{sum(effects.values())} side effects of {len(effects)} effect steps; "
          f"{sum(code != 201 for _key, code in driver.answers)} submits refused and sent again")
