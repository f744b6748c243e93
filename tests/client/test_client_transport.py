"""The client's own behaviour against a scripted server (httpx.MockTransport):
which calls are retried, the error envelope, the wait loop, SSE parsing and
resuming a dropped stream from the last event id."""

import json

import httpx
import pytest
from execgo_client import ExecGo, ExecGoError
from execgo_client.client import parse_sse

ENVELOPE = {"error": {"code": "internal", "message": "boom", "retryable": True, "source": "api", "details": {}}}


def run_json(run_id=1, state="EXECUTING", **extra):
    return {"id": run_id, "state": state, "closing_cause": "", "title": "t", "steps": [],
            "allowed_actions": {"cancel": None, "retry": None, "approval": None}, **extra}


def scripted(*answers):
    """A client whose server answers ``answers`` in order (an exception is raised instead)."""
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        answer = answers[min(len(calls), len(answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    return ExecGo("http://execgo.test/api/v1/", "tok", retries=3, backoff=0.001,
                  transport=httpx.MockTransport(handler)), calls


def test_submit_sends_token_and_one_idempotency_key_across_retries():
    client, calls = scripted(httpx.ConnectError("refused"), httpx.Response(503, json=ENVELOPE),
                             httpx.Response(201, json=run_json(7, "CREATED")))
    run = client.submit({"steps": []}, title="x")
    assert (run.id, run.state) == (7, "CREATED")
    assert len(calls) == 3
    assert {call.headers["Idempotency-Key"] for call in calls} == {calls[0].headers["Idempotency-Key"]}
    assert calls[0].headers["Authorization"] == "Token tok"
    assert calls[0].url == "http://execgo.test/api/v1/runs"
    assert json.loads(calls[0].content) == {"title": "x", "plan": {"steps": []}}


def test_cancel_is_not_retried_after_a_response_or_a_read_error():
    client, calls = scripted(httpx.Response(503, json=ENVELOPE))
    with pytest.raises(ExecGoError) as caught:
        client.cancel(1)
    assert len(calls) == 1
    error = caught.value
    assert (error.code, error.message, error.retryable, error.source, error.status) == (
        "internal", "boom", True, "api", 503)
    assert error.envelope == ENVELOPE

    client, calls = scripted(httpx.ReadError("reset"))
    with pytest.raises(ExecGoError, match="ReadError"):
        client.retry(1)
    assert len(calls) == 1

    client, calls = scripted(httpx.ConnectError("refused"), httpx.Response(202, json=run_json()))
    assert client.cancel(1).id == 1  # the connection never opened: nothing was sent
    assert len(calls) == 2


def test_a_4xx_is_raised_at_once_and_a_non_envelope_gets_one():
    conflict = {"error": {"code": "invalid_input", "message": "final", "retryable": False, "source": "api",
                          "details": {}}}
    client, calls = scripted(httpx.Response(409, json=conflict))
    with pytest.raises(ExecGoError) as caught:
        client.get(1)
    assert (caught.value.code, caught.value.status, len(calls)) == ("invalid_input", 409, 1)

    client, _ = scripted(httpx.Response(404, text="<html>not here</html>"))
    with pytest.raises(ExecGoError) as caught:
        client.get(1)
    assert (caught.value.code, caught.value.source, caught.value.status) == ("not_found", "client", 404)


def test_wait_loops_until_the_condition_holds():
    client, calls = scripted(httpx.Response(200, json=run_json(reached=False)),
                             httpx.Response(200, json=run_json(state="AWAITING_HITL", reached=True, allowed_actions={
                                 "approval": {"page": "/approvals/4/", "api": "/api/v1/approvals/4"}})))
    run = client.wait(1, until="any", timeout=90)
    assert run.needs_human and run.reached
    assert client.url(run.approval_page) == "http://execgo.test/approvals/4/"
    assert [dict(call.url.params) for call in calls] == [{"until": "any", "timeout": "60"}] * 2
    with pytest.raises(ValueError):
        client.wait(1, until="later")


def sse(*events):
    return "".join(f"id: {event['id']}\nevent: {event['type']}\ndata: {json.dumps(event)}\n\n" for event in events)


def event(event_id, type_="task_progressed", **data):
    return {"id": event_id, "type": type_, "run_id": 1, "task_id": "a", "handle_id": "h", "timestamp": "",
            "message": f"m{event_id}", "data": data}


def test_parse_sse_follows_the_rules():
    lines = [": keep-alive", "id: 3", "event: x", "data: {\"a\":", "data:1}", "", "retry: 10", "", "data: cut"]
    assert list(parse_sse(lines)) == [("3", "x", '{"a":\n1}')]


class CutStream(httpx.SyncByteStream):
    """A response body that breaks off like a dropped connection."""

    def __init__(self, text: str):
        self.text = text

    def __iter__(self):
        yield self.text.encode()
        raise httpx.ReadError("connection reset")


def test_stream_resumes_from_the_last_id_and_ends_at_the_final_state():
    streams = [
        httpx.Response(200, headers={"Content-Type": "text/event-stream"},
                       stream=CutStream(sse(event(1), event(2)) + 'id: 3\ndata: {"id": 3, "type": "task_pro')),
        httpx.Response(200, headers={"Content-Type": "text/event-stream"},
                       text=": keep-alive\n\n" + sse(event(3), event(4, "run_state_changed", to="SUCCEEDED"), event(5))),
    ]
    calls = []

    def handler(request):
        if not request.url.path.endswith("/stream"):  # the keep-alive makes the client look: not final yet
            return httpx.Response(200, json=run_json())
        calls.append(request)
        return streams[len(calls) - 1]

    client = ExecGo("http://execgo.test", "tok", backoff=0.001, transport=httpx.MockTransport(handler))
    events = list(client.stream(1))
    assert [item.id for item in events] == [1, 2, 3, 4]
    assert events[-1].final_state and not events[0].final_state
    assert events[0].message == "m1" and events[0].data == {}
    assert "Last-Event-ID" not in calls[0].headers
    assert calls[1].headers["Last-Event-ID"] == "2"
    assert calls[1].url.path == "/api/v1/runs/1/stream"


def test_a_stream_closed_early_is_over_when_the_run_is_final():
    answers = {"/api/v1/runs/1/stream": httpx.Response(200, text=sse(event(1)), headers={
        "Content-Type": "text/event-stream"}), "/api/v1/runs/1": httpx.Response(200, json=run_json(state="SUCCEEDED"))}
    client = ExecGo("http://execgo.test", "tok", transport=httpx.MockTransport(lambda r: answers[r.url.path]))
    assert [item.id for item in client.stream(1, last_event_id=0)] == [1]


class KeepAlives(httpx.SyncByteStream):
    """A server with nothing more to send (resumed after the run's last event): keep-alives forever."""

    def __iter__(self):
        while True:
            yield b": keep-alive\n\n"


def test_a_quiet_stream_of_a_final_run_ends():
    answers = {"/api/v1/runs/1/stream": httpx.Response(200, stream=KeepAlives(), headers={
        "Content-Type": "text/event-stream"}), "/api/v1/runs/1": httpx.Response(200, json=run_json(state="SUCCEEDED"))}
    client = ExecGo("http://execgo.test", "tok", transport=httpx.MockTransport(lambda r: answers[r.url.path]))
    assert list(client.stream(1, last_event_id=99)) == []
