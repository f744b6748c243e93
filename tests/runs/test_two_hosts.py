"""Two worker hosts, two web processes and one beat against one PostgreSQL
and one Redis, as a deployment scales out on more machines.

Each host is a real worker with a host name and a data directory of its
own (its task directories, its fork server, its ledger row); the web
processes are real Daphne servers; beat runs the deadline scan, the sweeper
and the ledger heal. Runs of sequential `sleep` steps spread over both
hosts; one host is killed (its whole process group, no restart) while its
steps run. Every run still reaches a final state: its steps go on on the
other host, or, for a step the dead host was running, the run is closed at
its deadline. A live page on either web process hears every state change
of every run.
"""

import asyncio
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.conf import settings

from runs.models import Event, EventType, Run, Step, StepRunStatus
from runs.statemachine import FINAL
from runtime import forkserver
from tests.conftest import ROOT, WorkerProcess, _worker_env, log_tails, purge_broker, wait_for_run, wait_until
from tests.pages.conftest import DaphneServer, session_cookie
from tests.pages.test_live_relay import ended, receive, run_async, ws_url
from tests.reliability.checker import check_history

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif(settings.IS_SQLITE, reason="hosts share PostgreSQL and Redis; the embedded "
                                 "broker is one machine's folder")]

RUNS, STEPS, RUN_TIMEOUT_S = 8, 3, 25
# Beat's scans every second: a run past its deadline is closed within about a second of it, and
# a run whose message died with host-b (prefetched or half done, unacknowledged: a step's, or a
# stage's such as PLANNING's) is sent it again after 3 s of standing still.
FAST = {"EXECGO_DEADLINE_SCAN_INTERVAL_S": "1", "EXECGO_SWEEP_INTERVAL_S": "1",
        "EXECGO_LEDGER_HEAL_INTERVAL_S": "1", "EXECGO_DISPATCH_RELAY_INTERVAL_S": "1",
        **{f"EXECGO_ZOMBIE_{state}_S": "3" for state in ("CREATED", "PREPARING", "PLANNING", "POLICY_CHECK",
                                                          "TRACING", "TRANSIENT", "EXECUTING_IDLE")}}


class Beat:
    def __init__(self, tmp_path):
        self.log_path = tmp_path / "beat.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "execgo", "beat", "-l", "INFO", "--schedule",
             str(tmp_path / "beat-schedule")],
            cwd=ROOT, env={**_worker_env(), **FAST}, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
        self.log.close()


def host(name: str, tmp_path) -> WorkerProcess:
    data_dir = tmp_path / name
    data_dir.mkdir()
    return WorkerProcess(hostname=name, concurrency=2,
                         env={"EXECGO_HOST_NAME": name, "EXECGO_DATA_DIR": str(data_dir), **FAST})


def test_two_hosts_share_the_work_and_a_dead_one_loses_no_run(api, agent, tenant, tmp_path):
    purge_broker()
    hosts = {name: host(name, tmp_path) for name in ("host-a", "host-b")}
    webs = [DaphneServer(log_name="two-hosts-web-1.log"), DaphneServer(log_name="two-hosts-web-2.log")]
    beat = None
    listening = ThreadPoolExecutor(max_workers=1)
    try:
        for started in [*hosts.values(), *webs]:
            started.start()
        beat = Beat(tmp_path)
        cookie = session_cookie(agent)
        after = Event.objects.order_by("-id").values_list("id", flat=True).first() or 0
        plan = {"steps": [{"id": f"s{i}", "tool": "shell", "params": {"argv": ["sleep", "1"]}, "retries": 0,
                           **({"depends_on": [f"s{i - 1}"]} if i else {})} for i in range(STEPS)]}
        run_ids: list[int] = []
        for index in range(RUNS):
            response = api.post("/api/v1/runs", {"title": f"two hosts {index}", "plan": plan,
                                                 "timeout_s": RUN_TIMEOUT_S}, format="json")
            assert response.status_code == 201, response.content
            run_ids.append(response.json()["id"])

        async def listen_on_both():
            # From before the first submit: what a socket missed is sent as its backlog first.
            def until_all_ended():
                remaining = set(run_ids)

                def done(event) -> bool:
                    if ended(event):
                        remaining.discard(event["run_id"])
                    return not remaining

                return done

            return await asyncio.gather(*[receive(ws_url(web, scope="runs", after=after), cookie,
                                                  until=until_all_ended(), timeout=150) for web in webs])

        heard = listening.submit(run_async, listen_on_both())

        # Both hosts take steps; then host-b dies while it runs some.
        wait_until(lambda: set(Step.objects.filter(run_id__in=run_ids, host__in=hosts).values_list("host", flat=True))
                   == set(hosts) and Step.objects.filter(run_id__in=run_ids, host="host-b",
                                                         run_status=StepRunStatus.RUNNING).exists(),
                   timeout=60, what="steps running on both hosts")
        os.killpg(hosts["host-b"].proc.pid, signal.SIGKILL)
        hosts["host-b"].proc.wait(timeout=30)
        on_b_at_the_kill = set(Step.objects.filter(run_id__in=run_ids, host="host-b",
                                                   run_status=StepRunStatus.RUNNING).values_list("run_id", flat=True))

        for run_id in run_ids:
            wait_for_run(run_id, timeout=RUN_TIMEOUT_S + 60)
        received = heard.result(timeout=120)
    except (AssertionError, pytest.fail.Exception) as exc:
        raise AssertionError(f"{exc}{log_tails(*hosts.values())}") from exc
    finally:
        listening.shutdown(wait=False)
        for started in [*hosts.values(), *webs, *([beat] if beat else [])]:
            started.stop()
        forkserver.stop_server(str(tmp_path / "host-b" / "tasks"))

    runs = Run.objects.in_bulk(run_ids)
    assert on_b_at_the_kill  # the kill caught host-b running steps
    assert all(run.state in FINAL for run in runs.values())
    for run_id, run in runs.items():
        if run_id in on_b_at_the_kill:
            # Its step's shim outlived host-b, but nobody is left there to record it: closed at the deadline.
            assert (run.state, run.closing_cause) == ("CLOSED_FAILED", "run_timeout"), (run_id, run.state)
        else:
            assert run.state == "SUCCEEDED", (run_id, run.state, run.closing_cause)
            assert Step.objects.filter(run_id=run_id, run_status=StepRunStatus.SUCCESS, attempt=1).count() == STEPS
    assert any(run.state == "SUCCEEDED" for run in runs.values())
    # After the kill, every step that started did so on host-a.
    hosts_used = set(Step.objects.filter(run_id__in=run_ids).exclude(host="").values_list("host", flat=True))
    assert hosts_used == {"host-a", "host-b"}

    # Either web process relayed every state change of every run, in order.
    server = list(Event.objects.filter(run_id__in=run_ids, type=EventType.RUN_STATE_CHANGED, id__gt=after)
                  .order_by("id").values_list("id", flat=True))
    for events in received:
        assert [event["id"] for event in events if event["run_id"] in runs] == server

    assert check_history(run_ids, grace_s=10, export_dir=tmp_path) == []  # reconcile's invariants included
