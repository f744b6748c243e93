"""The llm planner against a real chat-completions endpoint on 127.0.0.1.

The endpoint is a ThreadingHTTPServer answering from a script of replies
and recording every request it received; nothing in the planner is mocked.
"""

import contextlib
import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.db import transaction

from runs.execution import execute_claims
from runs.models import Run, Trace, TraceKind
from runs.pipeline import run_advance
from runs.planners import RAW_RESPONSE_TRACE_BYTES, PlanningFailed, plan_run
from runs.services import run_submit
from tests.conftest import free_port

API_KEY = "sk-planner-test-0123456789"
MODEL = "planner-test-model"
GOAL = "Print a greeting, then count to three."
TIMEOUT_S = 0.5

VALID_PLAN = {"steps": [
    {"id": "greet", "tool": "shell", "params": {"argv": ["echo", "hello from the planner"]}},
    {"id": "count", "tool": "shell", "params": {"script": "echo $((1 + 2))"}, "depends_on": ["greet"]},
]}
CYCLIC_PLAN = {"steps": [
    {"id": "a", "tool": "shell", "params": {"argv": ["true"]}, "depends_on": ["b"]},
    {"id": "b", "tool": "shell", "params": {"argv": ["true"]}, "depends_on": ["a"]},
]}


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    delay_s: float = 0.0  # before the status line
    trickle_s: float = 0.0  # between body pieces, after the headers


def completion(content: str, **reply) -> Reply:
    body = {"id": "chatcmpl-1", "object": "chat.completion", "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 120, "completion_tokens": 40, "total_tokens": 160}}
    return Reply(body=json.dumps(body).encode(), **reply)


def plan_reply(plan: dict, **reply) -> Reply:
    return completion(json.dumps(plan), **reply)


GARBAGE = Reply(body=b"<html><body>502 upstream confused</body></html>")


class ChatCompletionsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), ChatCompletionsHandler)
        self.replies: list[Reply] = []
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.closing = threading.Event()  # wakes handlers still sleeping at teardown

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def script(self, *replies: Reply) -> None:
        """Answer with these in order; the last one repeats."""
        self.replies = list(replies)

    def next_reply(self, request: dict) -> Reply:
        with self.lock:
            self.requests.append(request)
            return self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]


class ChatCompletionsHandler(BaseHTTPRequestHandler):
    server: ChatCompletionsServer

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        reply = self.server.next_reply({"path": self.path, "headers": dict(self.headers), "json": json.loads(raw)})
        if reply.delay_s and self.server.closing.wait(reply.delay_s):
            return
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            if reply.trickle_s:
                for start in range(0, len(reply.body), 16):
                    self.wfile.write(reply.body[start:start + 16])
                    self.wfile.flush()
                    if self.server.closing.wait(reply.trickle_s):
                        return
            else:
                self.wfile.write(reply.body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the planner gave up on this answer (timeout); that is the point

    def log_message(self, format, *args):
        pass


@contextlib.contextmanager
def serving_planner(settings):
    """A chat-completions endpoint on loopback, configured as the llm planner."""
    server = ChatCompletionsServer()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    settings.EXECGO_LLM_URL = server.base_url
    settings.EXECGO_LLM_MODEL = MODEL
    settings.EXECGO_LLM_API_KEY = API_KEY
    settings.EXECGO_LLM_TIMEOUT_S = TIMEOUT_S
    settings.EXECGO_LLM_RETRIES = 2
    settings.EXECGO_LLM_BACKOFF_S = 0.01
    try:
        yield server
    finally:
        server.closing.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def llm(settings):
    with serving_planner(settings) as server:
        yield server


@pytest.fixture
def llm_run(tenant, agent):
    return run_submit(tenant=tenant, user=agent, planner="llm", goal=GOAL).run


def planning_failure(run: Run) -> PlanningFailed:
    with pytest.raises(PlanningFailed) as caught:
        plan_run(run)
    assert API_KEY not in json.dumps(caught.value.trace_data)
    assert API_KEY not in json.dumps(caught.value.envelope)
    return caught.value


# --- the planner against the endpoint --------------------------------------------


@pytest.mark.django_db
def test_request_carries_goal_model_key_and_schema(llm, llm_run):
    llm.script(plan_reply(VALID_PLAN))

    steps, trace = plan_run(llm_run)

    assert [(s["id"], s["tool"], s["depends_on"]) for s in steps] == [("greet", "shell", []),
                                                                      ("count", "shell", ["greet"])]
    assert steps[0]["timeout_s"] > 0 and steps[0]["retries"] == 0  # normalised by validate_plan
    [request] = llm.requests
    assert request["path"] == "/v1/chat/completions"
    assert request["headers"]["Authorization"] == f"Bearer {API_KEY}"
    body = request["json"]
    assert body["model"] == MODEL
    assert body["temperature"] == 0
    assert body["response_format"] == {"type": "json_object"}
    system, user = body["messages"]
    assert user == {"role": "user", "content": GOAL}
    assert system["role"] == "system"
    for needle in ('"steps"', '"depends_on"', '"argv"', '"script"', '"shell"', '"http"', '"file"'):
        assert needle in system["content"]

    assert trace["planner"] == "llm"
    assert trace["model"] == MODEL
    [attempt] = trace["attempts"]
    assert attempt["attempt"] == 1 and attempt["http_status"] == 200 and attempt["latency_ms"] >= 0
    assert json.loads(trace["raw_response"])["choices"][0]["message"]["content"] == json.dumps(VALID_PLAN)
    assert trace["usage"]["total_tokens"] == 160
    assert API_KEY not in json.dumps(trace)


@pytest.mark.django_db
def test_fenced_json_reply_is_accepted(llm, llm_run):
    llm.script(completion("Here is the plan:\n```json\n" + json.dumps(VALID_PLAN, indent=2) + "\n```\n"))

    steps, _ = plan_run(llm_run)

    assert [s["id"] for s in steps] == ["greet", "count"]


@pytest.mark.django_db
def test_garbage_body_fails_at_once(llm, llm_run):
    llm.script(GARBAGE, plan_reply(VALID_PLAN))

    failure = planning_failure(llm_run)

    assert failure.timed_out is False
    assert failure.envelope["code"] == "external_failure"
    assert failure.envelope["source"] == "scheduler"
    assert failure.envelope["retryable"] is False
    assert "chat completion" in failure.envelope["message"]
    assert len(llm.requests) == 1  # not retried: the valid plan scripted next was never asked for
    assert failure.trace_data["raw_response"] == GARBAGE.body.decode()


@pytest.mark.django_db
def test_prose_reply_is_external_failure(llm, llm_run):
    llm.script(completion("I would start by greeting the user, then count."))

    failure = planning_failure(llm_run)

    assert (failure.envelope["code"], failure.envelope["message"]) == ("external_failure", "planner reply is not JSON")
    assert len(llm.requests) == 1


@pytest.mark.django_db
def test_cyclic_plan_is_invalid_input(llm, llm_run):
    llm.script(plan_reply(CYCLIC_PLAN))

    failure = planning_failure(llm_run)

    assert failure.timed_out is False
    assert failure.envelope["code"] == "invalid_input"
    assert failure.envelope["source"] == "scheduler"
    assert "dependency cycle" in failure.envelope["message"]
    assert failure.envelope["details"] == {"steps": ["a", "b"]}
    assert len(llm.requests) == 1


@pytest.mark.django_db
def test_server_error_then_valid_plan_is_retried(llm, llm_run):
    llm.script(Reply(status=500, body=b'{"error": "overloaded"}'), plan_reply(VALID_PLAN))

    steps, trace = plan_run(llm_run)

    assert [s["id"] for s in steps] == ["greet", "count"]
    assert len(llm.requests) == 2
    assert [(a["attempt"], a["http_status"], a["outcome"]) for a in trace["attempts"]] == [
        (1, 500, "retryable_status"), (2, 200, "answered"),
    ]
    assert all(a["latency_ms"] >= 0 for a in trace["attempts"])


@pytest.mark.django_db
def test_rate_limited_until_retries_run_out(llm, llm_run, settings):
    settings.EXECGO_LLM_RETRIES = 3
    llm.script(Reply(status=429, body=b'{"error": "slow down"}'))

    failure = planning_failure(llm_run)

    assert len(llm.requests) == 4
    assert failure.envelope["code"] == "external_failure"
    assert failure.envelope["retryable"] is True
    assert failure.envelope["details"] == {"attempts": 4}
    assert [a["http_status"] for a in failure.trace_data["attempts"]] == [429, 429, 429, 429]


@pytest.mark.django_db
def test_client_error_is_not_retried(llm, llm_run):
    llm.script(Reply(status=401, body=b'{"error": "bad key"}'), plan_reply(VALID_PLAN))

    failure = planning_failure(llm_run)

    assert len(llm.requests) == 1
    assert failure.envelope["code"] == "external_failure"
    assert failure.envelope["details"] == {"http_status": 401}
    assert failure.trace_data["raw_response"] == '{"error": "bad key"}'


@pytest.mark.django_db
def test_slow_answer_times_out_without_retry(llm, llm_run):
    llm.script(plan_reply(VALID_PLAN, delay_s=5))

    started = time.monotonic()
    failure = planning_failure(llm_run)
    elapsed = time.monotonic() - started

    assert failure.timed_out is True
    assert failure.envelope["code"] == "timeout"
    assert failure.envelope["retryable"] is True
    assert failure.envelope["details"]["timeout_ms"] == int(TIMEOUT_S * 1000)
    assert len(llm.requests) == 1
    assert elapsed < 5  # gave up long before the answer would have come
    [attempt] = failure.trace_data["attempts"]
    assert attempt["outcome"] == "timeout"
    assert attempt["latency_ms"] >= TIMEOUT_S * 1000 * 0.9


@pytest.mark.django_db
def test_answer_trickling_in_past_the_timeout_is_a_timeout(llm, llm_run):
    # Every piece arrives well within the socket timeout; only the whole
    # call is too slow.
    llm.script(plan_reply(VALID_PLAN, trickle_s=0.15))

    failure = planning_failure(llm_run)

    assert failure.timed_out is True
    assert failure.envelope["code"] == "timeout"
    assert len(llm.requests) == 1


@pytest.mark.django_db
def test_connection_refused_is_retried_then_fails(llm_run, settings):
    port = free_port()
    settings.EXECGO_LLM_URL = f"http://127.0.0.1:{port}/v1"
    settings.EXECGO_LLM_RETRIES = 2
    settings.EXECGO_LLM_BACKOFF_S = 0.01

    failure = planning_failure(llm_run)

    assert failure.timed_out is False
    assert failure.envelope["code"] == "external_failure"
    assert failure.envelope["retryable"] is True
    assert "ConnectionRefusedError" in failure.envelope["message"]
    assert [a["outcome"] for a in failure.trace_data["attempts"]] == ["connection_error"] * 3


@pytest.mark.django_db
def test_missing_url_fails_with_a_clear_message(llm, llm_run, settings):
    settings.EXECGO_LLM_URL = ""
    llm.script(plan_reply(VALID_PLAN))

    failure = planning_failure(llm_run)

    assert "EXECGO_LLM_URL" in failure.envelope["message"]
    assert failure.envelope["retryable"] is False
    assert llm.requests == []


@pytest.mark.django_db
def test_run_without_goal_is_refused_before_any_call(llm, tenant, agent):
    run = run_submit(tenant=tenant, user=agent, planner="llm", goal="").run
    llm.script(plan_reply(VALID_PLAN))

    failure = planning_failure(run)

    assert failure.envelope["code"] == "invalid_input"
    assert llm.requests == []


@pytest.mark.django_db
def test_api_key_echoed_by_the_endpoint_is_redacted(llm, llm_run):
    # A misbehaving proxy that reflects the request headers into its error page.
    llm.script(Reply(status=400, body=f"bad request; Authorization: Bearer {API_KEY}".encode()))

    failure = planning_failure(llm_run)

    assert failure.trace_data["raw_response"] == "bad request; Authorization: Bearer [redacted]"


@pytest.mark.django_db
def test_raw_response_is_truncated_in_the_trace(llm, llm_run):
    padding = " " * (3 * RAW_RESPONSE_TRACE_BYTES)
    llm.script(completion(json.dumps(VALID_PLAN) + padding))

    _, trace = plan_run(llm_run)

    assert len(trace["raw_response"]) == RAW_RESPONSE_TRACE_BYTES
    assert trace["raw_response_bytes"] > 3 * RAW_RESPONSE_TRACE_BYTES


# --- whole runs, driven synchronously -------------------------------------------


def submit_and_drive(tenant, agent, goal: str = GOAL) -> Run:
    # A session-wide Celery worker (tests/conftest.py) may still be running
    # from an earlier module, without this test's planner settings. Driving
    # inside one transaction keeps the run invisible to it until the run is
    # final; the advance task enqueued at commit then finds nothing to do.
    with transaction.atomic():
        run = run_submit(tenant=tenant, user=agent, planner="llm", goal=goal).run
        execute_claims(run_advance(run.pk))
    return Run.objects.get(pk=run.pk)


def transitions(run: Run) -> list[tuple[str, str]]:
    return list(run.traces.filter(kind=TraceKind.TRANSITION).values_list("from_state", "to_state"))


def planner_trace(run: Run) -> Trace:
    return run.traces.get(kind=TraceKind.TOOL_INVOCATION, data__tool="planner")


@pytest.mark.django_db(transaction=True)
def test_valid_plan_runs_to_succeeded(llm, tenant, agent):
    llm.script(plan_reply(VALID_PLAN))

    run = submit_and_drive(tenant, agent)

    assert (run.state, run.closing_cause) == ("SUCCEEDED", "succeeded")
    # What the planner produced is kept with the run, normalised.
    assert [(s["id"], s["params"], s["depends_on"]) for s in run.plan["steps"]] == [
        ("greet", {"argv": ["echo", "hello from the planner"]}, []),
        ("count", {"script": "echo $((1 + 2))"}, ["greet"]),
    ]
    outputs = {step.step_id: (step.status, step.result["output"]) for step in run.steps.all()}
    assert outputs == {"greet": ("success", {"exit_code": 0, "stdout": "hello from the planner\n"}),
                       "count": ("success", {"exit_code": 0, "stdout": "3\n"})}
    trace = planner_trace(run)
    assert (trace.from_state, trace.to_state, trace.error) == ("PLANNING", "POLICY_CHECK", None)
    assert trace.data["planner"] == "llm" and trace.data["model"] == MODEL and trace.data["steps"] == 2
    assert len(trace.data["attempts"]) == 1
    assert llm.requests[0]["json"]["messages"][1]["content"] == GOAL


@pytest.mark.django_db(transaction=True)
def test_garbage_reply_closes_failed_with_the_envelope_traced(llm, tenant, agent):
    llm.script(GARBAGE)

    run = submit_and_drive(tenant, agent)

    assert (run.state, run.closing_cause) == ("CLOSED_FAILED", "failed")
    assert transitions(run)[-3:] == [("PLANNING", "FAILED"), ("FAILED", "TRACING"), ("TRACING", "CLOSED_FAILED")]
    trace = planner_trace(run)
    assert (trace.from_state, trace.to_state) == ("PLANNING", "FAILED")
    assert trace.error["code"] == "external_failure"
    assert trace.error["source"] == "scheduler"
    assert set(trace.error) == {"code", "message", "retryable", "source", "details"}
    assert trace.data["raw_response"] == GARBAGE.body.decode()
    assert not run.steps.exists()


@pytest.mark.django_db(transaction=True)
def test_invalid_plan_closes_failed_as_invalid_input(llm, tenant, agent):
    llm.script(plan_reply(CYCLIC_PLAN))

    run = submit_and_drive(tenant, agent)

    assert (run.state, run.closing_cause) == ("CLOSED_FAILED", "failed")
    assert planner_trace(run).error["code"] == "invalid_input"
    assert not run.steps.exists()


@pytest.mark.django_db(transaction=True)
def test_slow_planner_closes_failed_through_timeout(llm, tenant, agent):
    llm.script(plan_reply(VALID_PLAN, delay_s=5))

    run = submit_and_drive(tenant, agent)

    assert (run.state, run.closing_cause) == ("CLOSED_FAILED", "planning_timeout")
    assert transitions(run)[-3:] == [("PLANNING", "TIMEOUT"), ("TIMEOUT", "TRACING"), ("TRACING", "CLOSED_FAILED")]
    trace = planner_trace(run)
    assert (trace.from_state, trace.to_state) == ("PLANNING", "TIMEOUT")
    assert trace.error["code"] == "timeout" and trace.error["retryable"] is True
    assert API_KEY not in json.dumps(list(run.traces.values_list("data", "error")))
    assert not run.steps.exists()


# --- the API ----------------------------------------------------------------------


@pytest.mark.django_db
def test_api_accepts_an_llm_run_with_a_goal(api):
    response = api.post("/api/v1/runs", {"planner": "llm", "goal": GOAL}, format="json")

    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["planner"], body["goal"], body["state"], body["plan"]) == ("llm", GOAL, "CREATED", {})
    run = Run.objects.get(pk=body["id"])
    assert (run.planner, run.goal) == ("llm", GOAL)


@pytest.mark.django_db
def test_api_refuses_an_llm_run_without_a_goal(api):
    response = api.post("/api/v1/runs", {"planner": "llm"}, format="json")

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_input"
    assert error["source"] == "api"
    assert "goal" in error["message"]
    assert not Run.objects.exists()
