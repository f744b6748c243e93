"""The agents' side of the API: idempotent submits, waiting without polling,
the SSE stream, allowed actions, the policy dry run, and run callbacks."""

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from django.db import connection

from runs.models import AuditLog, Event, Run, Trace
from tests.conftest import (
    WorkerProcess,
    make_token,
    postgres_only,
    purge_broker,
    simple_plan,
    token_client,
    wait_for_run,
)
from tests.runs.test_webhooks import Receiver

PLAN = simple_plan(["true"])


def get(url: str, token: str, *, headers: dict | None = None, timeout: float = 90) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Token {token}", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def agent_token(agent) -> str:
    return make_token(agent)


# --- idempotency ------------------------------------------------------------------


@pytest.mark.django_db
def test_the_same_key_with_another_body_is_a_conflict(api):
    first = api.post("/api/v1/runs", {"plan": PLAN}, format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    other = api.post("/api/v1/runs", {"plan": simple_plan(["false"])}, format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    assert first.status_code == 201
    assert other.status_code == 409 and other.json()["error"]["code"] == "invalid_input"
    assert Run.objects.count() == 1


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_fifty_concurrent_submits_with_one_key_make_one_run(agent):
    barrier = threading.Barrier(50)

    def submit(_):
        try:
            barrier.wait()
            response = token_client(agent).post("/api/v1/runs", {"plan": PLAN}, format="json",
                                                HTTP_IDEMPOTENCY_KEY="the-one")
            return response.status_code, response.json()["id"]
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=50) as pool:
        results = list(pool.map(submit, range(50)))
    purge_broker()
    assert Run.objects.count() == 1
    assert {run_id for _, run_id in results} == {Run.objects.get().pk}
    assert sorted(code for code, _ in results) == [200] * 49 + [201]


# --- allowed actions and the policy dry run ---------------------------------------


@pytest.mark.django_db
def test_allowed_actions_follow_the_state(api, make_run):
    from tests.conftest import open_approval

    executing, final, waiting = make_run("EXECUTING"), make_run("CLOSED_FAILED", closing_cause="failed"), \
        make_run("AWAITING_HITL")
    closing = make_run("TRACING", closing_cause="succeeded")  # its ending is decided: a cancel would be a 409
    approval = open_approval(waiting)
    actions = {run.pk: api.get(f"/api/v1/runs/{run.pk}").json()["allowed_actions"] for run in (executing, final,
                                                                                               waiting, closing)}
    assert actions[closing.pk]["cancel"] is None
    assert api.post(f"/api/v1/runs/{closing.pk}/cancel").status_code == 409
    assert actions[executing.pk] == {"cancel": {"method": "POST", "url": f"/api/v1/runs/{executing.pk}/cancel"},
                                     "retry": None, "approval": None}
    assert actions[final.pk]["cancel"] is None and actions[final.pk]["retry"]["url"] == f"/api/v1/runs/{final.pk}/retry"
    assert actions[waiting.pk]["approval"] == {"page": f"/approvals/{approval.pk}/",
                                               "api": f"/api/v1/approvals/{approval.pk}"}


@pytest.mark.django_db
def test_the_policy_dry_run_rates_like_policy_check_and_writes_nothing(api, seeded_policy):
    counts = (Run.objects.count(), Trace.objects.count(), AuditLog.objects.count(), Event.objects.count())
    high = api.post("/api/v1/policy/evaluate", {"plan": simple_plan(["echo", "hi"], ["pip", "install", "x"])},
                    format="json")
    denied = api.post("/api/v1/policy/evaluate", {"plan": simple_plan(["sudo", "true"])}, format="json")
    bad = api.post("/api/v1/policy/evaluate", {"plan": {"steps": []}}, format="json")

    assert high.status_code == 200, high.content
    body = high.json()
    assert (body["risk"], body["needs_human"], body["rejected"]) == ("high", True, False)
    assert [step["risk"] for step in body["steps"]] == ["low", "high"]
    assert [rule["rule"] for rule in body["matched_rules"]] == ["shell-package-install"]
    assert body["budget"]["steps"] == 2 and isinstance(body["policy_version"], int)
    assert denied.json()["rejected"] is True and denied.json()["risk"] == "deny"
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_input"
    assert (Run.objects.count(), Trace.objects.count(), AuditLog.objects.count(), Event.objects.count()) == counts


# --- waiting and streaming, against a live server and a real worker ------------------


@pytest.mark.django_db(transaction=True)
def test_wait_returns_at_the_final_state_and_at_its_timeout(live_web, celery_worker, agent):
    token = agent_token(agent)
    run_id = token_client(agent).post("/api/v1/runs", {"plan": simple_plan(["sleep", "1"])}, format="json").json()["id"]

    status, _, body = get(f"{live_web.url}/api/v1/runs/{run_id}/wait?until=final&timeout=30", token)
    returned = time.time()

    run = Run.objects.get(pk=run_id)
    assert status == 200 and json.loads(body)["reached"] is True and json.loads(body)["state"] == "SUCCEEDED"
    assert returned - run.finished_at.timestamp() < 1.0  # woken by the commit (the figure itself: bench/)
    status, _, body = get(f"{live_web.url}/api/v1/runs/{run_id}/wait?until=needs_human&timeout=0.5", token)
    assert status == 200 and json.loads(body)["reached"] is False
    assert get(f"{live_web.url}/api/v1/runs/{run_id}/wait?until=later", token)[0] == 400
    assert get(f"{live_web.url}/api/v1/runs/{run_id}/wait", "not-a-token")[0] == 401


@pytest.mark.django_db(transaction=True)
def test_two_hundred_waiters_return_without_a_thread_each(live_web, celery_worker, agent):
    token = agent_token(agent)
    run_id = token_client(agent).post("/api/v1/runs", {"plan": simple_plan(["sleep", "3"])}, format="json").json()["id"]
    server = psutil.Process(live_web.proc.pid)
    threads = []

    def wait(_):
        return get(f"{live_web.url}/api/v1/runs/{run_id}/wait?until=final&timeout=60", token)

    with ThreadPoolExecutor(max_workers=200) as pool:
        futures = [pool.submit(wait, n) for n in range(200)]
        while not all(future.done() for future in futures):
            threads.append(server.num_threads())
            time.sleep(0.2)
        results = [future.result() for future in futures]
    assert [status for status, _, _ in results] == [200] * 200
    assert all(json.loads(body)["state"] == "SUCCEEDED" for _, _, body in results)
    assert max(threads) < 60, f"the web process grew to {max(threads)} threads"


def read_sse(url: str, token: str, *, last_event_id: int | None = None, stop_after: int | None = None) -> list:
    headers = {"Last-Event-ID": str(last_event_id)} if last_event_id else {}
    request = urllib.request.Request(url, headers={"Authorization": f"Token {token}", **headers})
    events, fields = [], {}
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        for raw in response:
            line = raw.decode().rstrip("\n")
            if line.startswith(":"):
                continue
            if line == "":
                if fields:
                    events.append(json.loads(fields["data"]))
                    assert int(fields["id"]) == events[-1]["id"] and fields["event"] == events[-1]["type"]
                    fields = {}
                    if stop_after is not None and len(events) >= stop_after:
                        break
                continue
            name, _, value = line.partition(": ")
            fields[name] = value
    return events


@pytest.mark.django_db(transaction=True)
def test_an_sse_client_resumes_with_exactly_the_servers_events(live_web, celery_worker, agent):
    token = agent_token(agent)
    plan = simple_plan(*[["sleep", "0.2"]] * 5)
    run_id = token_client(agent).post("/api/v1/runs", {"plan": plan}, format="json").json()["id"]
    url = f"{live_web.url}/api/v1/runs/{run_id}/stream"

    first = read_sse(url, token, stop_after=4)
    time.sleep(0.5)
    rest = read_sse(url, token, last_event_id=first[-1]["id"])  # ends by itself after the final state

    assert wait_for_run(run_id).state == "SUCCEEDED"
    assert [event["id"] for event in first + rest] == list(
        Event.objects.filter(run_id=run_id).order_by("id").values_list("id", flat=True))
    assert rest[-1]["type"] == "run_state_changed" and rest[-1]["data"]["to"] == "SUCCEEDED"
    assert read_sse(url, token, last_event_id=rest[-1]["id"]) == []  # nothing left: it closes at once


# --- callbacks ------------------------------------------------------------------------


@pytest.fixture
def callback_receiver():
    receiver = Receiver()
    threading.Thread(target=receiver.server.serve_forever, daemon=True).start()
    yield receiver
    receiver.server.shutdown()


@pytest.mark.django_db(transaction=True)
def test_a_final_run_calls_back_once_even_after_two_failures(callback_receiver, settings, agent):
    settings.EXECGO_CALLBACK_ALLOWED_HOSTS = ["127.0.0.1"]
    callback_receiver.secrets = {agent.membership.tenant.webhook_secret: agent.membership.tenant_id}
    purge_broker()
    worker = WorkerProcess(hostname="callbacks", env={
        "EXECGO_WEBHOOK_BACKOFF_S": "0.2", "EXECGO_WEBHOOK_MAX_ATTEMPTS": "5",
        "EXECGO_CALLBACK_ALLOWED_HOSTS": "127.0.0.1"}).start()
    try:
        client = token_client(agent)
        refused = client.post("/api/v1/runs", {"plan": PLAN, "callback_url": "https://elsewhere.example/hook"},
                              format="json")
        assert refused.status_code == 400 and "callback_url" in refused.json()["error"]["details"]["fields"]
        run_ids = [client.post("/api/v1/runs", {"plan": PLAN, "callback_url": callback_receiver.url},
                               format="json").json()["id"] for _ in range(3)]
        for run_id in run_ids:
            assert wait_for_run(run_id).state == "SUCCEEDED"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(callback_receiver.accepted) < 3:
            time.sleep(0.1)
        time.sleep(1.0)  # nothing more arrives
    finally:
        worker.stop()
    finals = [body for body in callback_receiver.accepted if body["event"] == "run.final"]
    assert sorted(body["data"]["run"] for body in finals) == sorted(run_ids)  # exactly one each
    assert all(body["data"]["state"] == "SUCCEEDED" for body in finals)
    assert callback_receiver.invalid == 0
    assert all(count == 3 for count in callback_receiver.attempts.values())  # 503, 503, 200
