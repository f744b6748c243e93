"""Structured logs: JSON lines carrying the ids of what is being handled
(request, tenant, run, step, handle), secrets redacted, end to end through
a real Daphne server and a real Celery worker writing their logs to files."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from django.contrib.auth.models import User

from execgo.logs import json_formatter, redact_text
from runs.models import Membership
from tests.conftest import (
    ROOT,
    WorkerProcess,
    _worker_env,
    free_port,
    make_token,
    make_user,
    purge_broker,
    token_client,
    wait_for_run,
)

pytestmark = pytest.mark.django_db


class Lines(logging.Handler):
    """The root logger's lines as the JSON formatter writes them."""

    def __init__(self):
        super().__init__()
        self.setFormatter(json_formatter())
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(self.format(record))

    def parsed(self) -> list[dict]:
        return [json.loads(line) for line in self.lines]


@pytest.fixture
def lines():
    handler = Lines()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)


SECRET = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b"


@pytest.mark.parametrize("message", [
    f"Authorization: Token {SECRET}",
    f"headers={{'Authorization': 'Bearer {SECRET}', 'Cookie': 'sessionid={SECRET}; csrftoken={SECRET}'}}",
    f"POST body username=alice&password={SECRET}&next=/",
    f'{{"password": "{SECRET}", "api_key": "{SECRET}"}}',
    f"connecting to postgres://execgo:{SECRET}@db:5432/execgo",
    f"redis://:{SECRET}@127.0.0.1:6379/0 refused",
    f"GET /api/v1/runs?token={SECRET}&page=2",
    f"webhook signature={SECRET}",
    f"X-Api-Key: {SECRET}",
])
def test_secrets_are_redacted_from_messages(lines, message):
    logging.getLogger("execgo.test").warning("%s", message)
    [line] = lines.lines
    assert SECRET not in line
    assert "[redacted]" in json.loads(line)["event"]


def test_secrets_are_redacted_from_tracebacks(lines):
    try:
        raise RuntimeError(f"upstream said: Authorization: Token {SECRET}")
    except RuntimeError:
        logging.getLogger("execgo.test").exception("call failed")
    [line] = lines.parsed()
    assert "RuntimeError" in line["exception"] and SECRET not in json.dumps(line)


def test_redaction_keeps_ordinary_text():
    text = "run 12 moved EXECUTING → TRACING; 2 tokens of output; a password-less step"
    assert redact_text(text) == text


def test_request_id_is_echoed_and_on_every_line_of_the_request(client, lines):
    response = client.get("/api/v1/runs/999999", HTTP_X_REQUEST_ID="edge-7f3a.1")
    assert response["X-Request-ID"] == "edge-7f3a.1"
    request_lines = [line for line in lines.parsed() if line.get("request_id") == "edge-7f3a.1"]
    assert {line["logger"] for line in request_lines} >= {"execgo.request"}
    assert all(line.get("run_id") == 999999 for line in request_lines)


@pytest.mark.parametrize("offered", ["x" * 129, "evil\r\nSet-Cookie: a=b", "Token abc def", "<script>", ""])
def test_an_unsafe_request_id_is_replaced(client, lines, offered):
    response = client.get("/healthz", HTTP_X_REQUEST_ID=offered)
    assert response.status_code == 200
    assert re.fullmatch(r"[0-9a-f]{32}", response["X-Request-ID"])
    [line] = [line for line in lines.parsed() if line["logger"] == "execgo.request"]
    assert line["request_id"] == response["X-Request-ID"]


def test_the_callers_tenant_is_bound(agent, tenant, other_tenant, lines):
    api = token_client(agent)
    assert api.get("/api/v1/runs").status_code == 200
    outsider = make_user("outsider", other_tenant)
    assert token_client(outsider).get("/api/v1/runs").status_code == 200
    forged = token_client(agent)
    forged.credentials(HTTP_AUTHORIZATION="Token not-a-real-key")
    assert forged.get("/api/v1/runs").status_code == 401
    access = [line for line in lines.parsed() if line["logger"] == "execgo.request"]
    assert [line.get("tenant_id") for line in access] == [tenant.pk, other_tenant.pk, None]
    assert len({line["request_id"] for line in access}) == 3
    assert "not-a-real-key" not in "".join(lines.lines)


# --- End to end: a real web server and a real worker, logging JSON to files ----------------

PASSWORD = "correct-horse-battery-staple-42"



def procfile_web(port: int) -> list[str]:
    """The Procfile's web command, on ``port``."""
    [line] = [line for line in (ROOT / "Procfile").read_text().splitlines() if line.startswith("web:")]
    program, *args = line.removeprefix("web:").removeprefix(" exec").replace("${EXECGO_PORT:-8000}", str(port)).split()
    assert program.endswith("/daphne")
    return [sys.executable, "-m", "daphne", *args]


@pytest.fixture
def web(tmp_path):
    """Daphne as the Procfile starts it, against the test database, its JSON log in a file."""
    port = free_port()
    log_path = tmp_path / "web.stdout"
    log_file = tmp_path / "web.jsonl"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            procfile_web(port), cwd=ROOT, env={**_worker_env(), "EXECGO_LOG_FILE": str(log_file), "EXECGO_LOG_FORMAT": "json"},
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while b"Listening on TCP address" not in log_path.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"daphne did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.1)
    try:
        yield f"http://127.0.0.1:{port}", log_file, log_path
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


PLAN = {"steps": [
    {"id": "hello", "tool": "shell", "params": {"argv": ["echo", "hello"]}},
    {"id": "count", "tool": "shell", "params": {"script": "echo $((40 + 2))"}, "depends_on": ["hello"]},
]}


@pytest.mark.django_db(transaction=True)
def test_a_run_through_the_api_and_a_worker_logs_json_with_its_ids_and_no_secret(agent, tenant, web, tmp_path,
                                                                                    settings):
    base, web_log, web_stdout = web
    token = make_token(agent)
    person = User.objects.create_user(username="operator", password=PASSWORD)
    Membership.objects.create(user=person, tenant=tenant)
    worker_log = tmp_path / "worker.jsonl"
    purge_broker()
    worker = WorkerProcess(hostname="wlogs", env={"EXECGO_LOG_FILE": str(worker_log), "EXECGO_LOG_FORMAT": "json"})
    worker.start()
    try:
        with httpx.Client(base_url=base, timeout=30) as browser:
            form = browser.get("/accounts/login/")
            csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text).group(1)
            wrong = browser.post("/accounts/login/", data={"username": "operator", "password": PASSWORD[::-1],
                                                           "csrfmiddlewaretoken": csrf})
            assert wrong.status_code == 200  # the form again, with its error
            logged_in = browser.post("/accounts/login/", data={"username": "operator", "password": PASSWORD,
                                                               "csrfmiddlewaretoken": csrf})
            assert logged_in.status_code == 302, logged_in.text[-2000:]
            with httpx.Client(base_url=base, timeout=30, headers={"Authorization": f"Token {token}"}) as api:
                created = api.post("/api/v1/runs", json={"title": "logged", "plan": PLAN},
                                   headers={"X-Request-ID": "submit-1"})
                assert created.status_code == 201, created.text
                assert created.headers["X-Request-ID"] == "submit-1"
                run_id = created.json()["id"]
                run = wait_for_run(run_id)
                assert run.state == "SUCCEEDED"
                assert api.get(f"/api/v1/runs/{run_id}").status_code == 200
                # A token put where it does not belong is not logged either.
                assert api.get(f"/api/v1/runs/999999?token={token}").status_code == 404
            assert browser.get(f"/runs/{run_id}/").status_code == 200
    finally:
        worker.stop()

    files = {"web": web_log.read_text(), "worker": worker_log.read_text(),
             "worker stdout": worker.log_path.read_text(), "web stdout": web_stdout.read_text()}
    for name, text in files.items():
        assert token not in text, f"the agent's token is in the {name} log"
        assert PASSWORD not in text and PASSWORD[::-1] not in text, f"a password is in the {name} log"
    parsed = {}
    for name in ("web", "worker"):
        parsed[name] = [json.loads(line) for line in files[name].splitlines()]  # every line is JSON
        assert parsed[name], f"nothing in the {name} log"

    # The worker: every line of a task of this run carries the run's id; steps carry their ids.
    # (The host's own tasks — sweeps, deadline scans, ledger heals — belong to no run.)
    run_tasks = {"runs.tasks.advance_run", "runs.tasks.execute_step", "runs.tasks.settle_run"}
    run_task_lines = [line for line in parsed["worker"] if line.get("task_name") in run_tasks]
    assert run_task_lines, files["worker"][-3000:]
    assert {line.get("run_id") for line in run_task_lines} == {run_id}
    assert any(line.get("step_id") in {"hello", "count"} and line.get("handle_id") and line.get("tenant_id")
               == tenant.pk for line in run_task_lines)
    assert any("succeeded" in line["event"] for line in run_task_lines)

    # The web: each request's lines carry its id, the caller's tenant and the run named by the URL.
    access = [line for line in parsed["web"] if line["logger"] == "execgo.request"]
    [submit] = [line for line in access if line["request_id"] == "submit-1"]
    assert (submit["method"], submit["path"], submit["status"], submit["tenant_id"]) == (
        "POST", "/api/v1/runs", 201, tenant.pk)
    detail = [line for line in access if line["path"] == f"/api/v1/runs/{run_id}"]
    assert detail and all(line["run_id"] == run_id and line["tenant_id"] == tenant.pk for line in detail)
    [page] = [line for line in access if line["path"] == f"/runs/{run_id}/"]
    assert (page["run_id"], page["tenant_id"], page["status"]) == (run_id, tenant.pk, 200)
    assert all(line.get("request_id") for line in access)
    assert not any("?" in line["path"] for line in access)


def test_the_console_leaves_out_only_the_routine_lines_of_periodic_tasks():
    from execgo.logs import QuietPeriodicTasks

    quiet = QuietPeriodicTasks(tasks=["runs.tasks.sweep_zombie_runs"])

    def record(name, level, msg, args):
        return logging.LogRecord(name, level, __file__, 1, msg, args, None)

    received = "Task %(name)s[%(id)s] received"
    assert not quiet.filter(record("celery.worker.strategy", logging.INFO, received,
                                   ({"name": "runs.tasks.sweep_zombie_runs", "id": "1"},)))
    assert quiet.filter(record("celery.worker.strategy", logging.INFO, received,
                               ({"name": "runs.tasks.advance_run", "id": "2"},)))
    assert not quiet.filter(record("celery.beat", logging.INFO, "Scheduler: Sending due task %s (%s)",
                                   ("sweep-zombie-runs", "runs.tasks.sweep_zombie_runs")))
    failed = record("celery.app.trace", logging.ERROR, "Task %(name)s[%(id)s] raised",
                    ({"name": "runs.tasks.sweep_zombie_runs", "id": "3"},))
    assert quiet.filter(failed)
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.DEBUG)
    try:
        assert quiet.filter(record("celery.beat", logging.INFO, "Scheduler: Sending due task %s (%s)",
                                   ("sweep-zombie-runs", "runs.tasks.sweep_zombie_runs")))
    finally:
        root.setLevel(level)
