"""An http step holds no pool process while it waits on the network
(runtime/tool_process.py; docs/data-plane.md#steps-that-do-not-hold-a-worker).

On a real worker of two pool processes: three http steps whose server
holds its answer are handed to the watcher, a quick run gets through
meanwhile, and the held steps then succeed with their answers; a cancel
reaches a watched http step, whose request is dropped; the step's process
outlives a worker killed under it and the next worker records its answer.
"""

import json
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psutil
import pytest

from approvals.models import APPROVERS_GROUP, ApprovalRequest
from approvals.services import approval_decide
from runs.models import Step, StepRunStatus
from runtime import layout
from runtime.models import Reservation
from tests.conftest import WorkerProcess, log_tails, make_user, purge_broker, wait_for_run, wait_until
from tests.runs.test_step_watcher import shell_plan, submit, watched_by

ADDRESS = "127.0.0.1"
ENV = {"EXECGO_HOST_NAME": "http-watch-host", "EXECGO_TASK_SLOTS": "8",
       "EXECGO_HTTP_ALLOWED_NETWORKS": f"{ADDRESS}/32"}


class HeldServer:
    """Answers each GET once ``release`` is set (at most a minute later),
    counting the requests that came and those whose client went away."""

    def __init__(self):
        self.release = threading.Event()
        self.arrived, self.dropped, self.answered = [], [], []
        held = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                held.arrived.append(self.path)
                give_up = time.monotonic() + 60
                while not held.release.wait(0.05) and time.monotonic() < give_up:
                    # A client that went away has closed its end: the socket reads empty.
                    self.connection.settimeout(0)
                    try:
                        if self.connection.recv(1) == b"":
                            held.dropped.append(self.path)
                            return
                    except BlockingIOError:
                        pass
                    finally:
                        self.connection.settimeout(None)
                body = f"answer for {self.path}".encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                held.answered.append(self.path)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer((ADDRESS, 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://{ADDRESS}:{self.server.server_address[1]}/{path}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def http_plan(url: str) -> dict:
    return {"steps": [{"id": "only", "tool": "http", "retries": 0, "timeout_s": 120, "params": {"url": url}}]}


@pytest.fixture
def submit_approved(api, tenant):
    """Submit an http run and approve it: a loopback destination, though
    allow-listed, is rated high (docs/policy.md)."""
    approver = make_user("http-approver", tenant, groups=(APPROVERS_GROUP,))

    def submit_it(url: str) -> int:
        run_id = submit(api, http_plan(url))
        wait_until(lambda: ApprovalRequest.objects.filter(run_id=run_id, status="pending").exists(), timeout=60,
                   what="the run's approval request")
        request = ApprovalRequest.objects.get(run_id=run_id, status="pending")
        approval_decide(request=request, actor=approver, approve=True, digest=request.action_digest)
        return run_id

    return submit_it


@pytest.fixture
def held():
    server = HeldServer()
    yield server
    server.close()


@pytest.fixture
def worker(transactional_db):
    purge_broker()
    started = WorkerProcess(hostname="http-watching", concurrency=2, env=ENV).start()
    try:
        yield started
    finally:
        started.stop()


def step_process(step: Step) -> dict:
    return json.loads((layout.task_dir(step.handle_id) / layout.LAUNCH_FILE).read_text())


@pytest.mark.django_db(transaction=True)
def test_http_steps_waiting_on_their_server_hold_no_pool_process(api, worker, held, submit_approved):
    try:
        waiting = [submit_approved(held.url(f"held-{n}")) for n in range(3)]
        wait_until(lambda: watched_by(worker, waiting), timeout=60, what="three http steps handed to the watcher")
        wait_until(lambda: sorted(held.arrived) == ["/held-0", "/held-1", "/held-2"], timeout=30,
                   what="the three requests at the server")

        quick = wait_for_run(submit(api, shell_plan("echo quick")), timeout=60)
        assert quick.state == "SUCCEEDED", quick.state
        assert Step.objects.filter(run_id__in=waiting, run_status=StepRunStatus.RUNNING).count() == 3

        held.release.set()
        for n, run_id in enumerate(waiting):
            run = wait_for_run(run_id, timeout=60)
            assert run.state == "SUCCEEDED", run.state
            step = run.steps.get()
            assert step.result["output"] == {"status_code": 200, "body": f"answer for /held-{n}"}
            assert step_process(step)["via"] == "fork"
    except (AssertionError, pytest.fail.Exception) as exc:
        raise AssertionError(f"{exc}{log_tails(worker)}") from exc
    assert "runs.tasks.record_watched_step" in worker.log_path.read_text()
    handles = list(Step.objects.filter(run_id__in=waiting).values_list("handle_id", flat=True))
    wait_until(lambda: not Reservation.objects.filter(handle_id__in=handles).exists(), timeout=30,
               what="the http steps' slots given back")


@pytest.mark.django_db(transaction=True)
def test_a_cancel_reaches_a_watched_http_step_and_drops_its_request(api, worker, held, submit_approved):
    run_id = submit_approved(held.url("to-cancel"))
    try:
        wait_until(lambda: watched_by(worker, [run_id]), timeout=60, what="the http step handed to the watcher")
        # The hand-off can come before the helper has connected: the request is at the server first.
        wait_until(lambda: held.arrived == ["/to-cancel"], timeout=30, what="the request at the server")
        assert api.post(f"/api/v1/runs/{run_id}/cancel", {"reason": "enough"}, format="json").status_code == 202
        run = wait_for_run(run_id, timeout=60)
    except (AssertionError, pytest.fail.Exception) as exc:
        raise AssertionError(f"{exc}{log_tails(worker)}") from exc
    assert run.state == "CLOSED_CANCELLED", run.state
    step = run.steps.get()
    assert step.run_status == StepRunStatus.CANCELLED
    wait_until(lambda: held.dropped == ["/to-cancel"], timeout=30, what="the request dropped with its step")
    assert held.answered == []
    process = step_process(step)
    assert not psutil.pid_exists(process["pid"]) or psutil.Process(process["pid"]).status() == psutil.STATUS_ZOMBIE


@pytest.mark.django_db(transaction=True)
def test_an_http_step_outlives_a_killed_worker_and_the_next_one_records_it(worker, held, submit_approved):
    run_id = submit_approved(held.url("survivor"))
    try:
        wait_until(lambda: watched_by(worker, [run_id]), timeout=60, what="the http step handed to the watcher")
        step = Step.objects.get(run_id=run_id)
        process = step_process(step)
        worker.stop(signal.SIGKILL)  # the main process and its watcher; the step's process runs on
        assert psutil.pid_exists(process["pid"])
        held.release.set()
        wait_until(lambda: held.answered == ["/survivor"], timeout=30, what="the held request answered")
        second = WorkerProcess(hostname="http-watching-2", concurrency=2, env=ENV).start()
        try:
            run = wait_for_run(run_id, timeout=60)
        finally:
            second.stop()
    except (AssertionError, pytest.fail.Exception) as exc:
        raise AssertionError(f"{exc}{log_tails(worker)}") from exc
    assert run.state == "SUCCEEDED", run.state
    step = run.steps.get()
    assert step.attempt == 1
    assert step.result["output"] == {"status_code": 200, "body": "answer for /survivor"}
