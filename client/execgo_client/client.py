"""A small synchronous client of the ExecGo REST API (``/api/v1/``), over httpx.

Only what an agent needs: submit a plan, read, wait for and stream a run,
cancel and retry it, evaluate a plan against the policy, list approvals.
Every failure is one ``ExecGoError`` carrying the server's error envelope
(``errors.py``); the answers are the dataclasses of ``resources.py``, all
importable from here as before.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import httpx

from execgo_client.errors import ExecGoError, transport_error
from execgo_client.resources import FINAL_STATES, NEEDS_HUMAN_STATES, Approval, Evaluation, Event, Run

__all__ = [
    "FINAL_STATES", "NEEDS_HUMAN_STATES", "Approval", "Evaluation", "Event", "ExecGo", "ExecGoError", "Run",
]

VERSION = "0.1.0"
Until = Literal["final", "needs_human", "any"]
UNTIL_STATES: dict[str, frozenset[str]] = {
    "final": FINAL_STATES,
    "needs_human": NEEDS_HUMAN_STATES,
    "any": FINAL_STATES | NEEDS_HUMAN_STATES,
}
WAIT_MAX_S = 60  # the server's cap on one /wait call
STREAM_READ_TIMEOUT_S = 45.0  # the server sends ": keep-alive" every 15 s
BACKOFF_MAX_S = 10.0
# Nothing reached the server: even a call that is not idempotent may go again.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)


def parse_sse(lines: Iterable[str], *, comments: bool = False) -> Iterator[tuple[str | None, str, str]]:
    """(id, event, data) of each event in a text/event-stream, by the WHATWG
    rules: ``:`` starts a comment, one space after the colon is dropped,
    ``data`` lines join with newlines, a blank line dispatches (an event
    without one, cut off by a dropped connection, is dropped). With
    ``comments``, each comment comes as (None, ":", its text)."""
    event_id: str | None = None
    event_type = ""
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield event_id, event_type, "\n".join(data)
            event_type, data = "", []
            continue
        if line.startswith(":"):
            if comments:
                yield None, ":", line[1:].strip()
            continue
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "id" and "\0" not in value:
            event_id = value
        elif name == "event":
            event_type = value
        elif name == "data":
            data.append(value)
    # An event cut off before its blank line is dropped: the resumed stream sends it again.


class ExecGo:
    """``ExecGo("http://127.0.0.1:8000", token)``; a context manager closing its connections."""

    def __init__(self, base_url: str, token: str, *, timeout: float = 30, retries: int = 3,
                 backoff: float = 0.5, transport: httpx.BaseTransport | None = None) -> None:
        base_url = base_url.rstrip("/")
        if base_url.endswith("/api/v1"):
            base_url = base_url[: -len("/api/v1")]
        self.base_url = base_url
        self.timeout = timeout
        self.retries = max(0, retries)
        self.backoff = backoff
        self._http = httpx.Client(
            base_url=base_url, timeout=timeout, transport=transport,
            headers={"Authorization": f"Token {token}", "Accept": "application/json",
                     "User-Agent": f"execgo-client/{VERSION}"},
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ExecGo:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def url(self, path: str) -> str:
        """An absolute URL for a path the server returned (``/approvals/3/``)."""
        return self.base_url + path if path.startswith("/") else path

    # --- the API ---------------------------------------------------------

    def submit(self, plan: dict[str, Any], *, title: str = "", idempotency_key: str | None = None,
               timeout_s: int | None = None, approval_timeout_s: int | None = None,
               callback_url: str | None = None, callback_events: list[str] | None = None) -> Run:
        """Submit a run. Retried safely: the Idempotency-Key (a uuid4 unless
        given) makes a repeated POST answer with the run it already made.
        ``callback_url`` (its host allowed by the server) receives a signed
        webhook on ``callback_events`` (the server's default: ``final``)."""
        body: dict[str, Any] = {"title": title, "plan": plan}
        for name, value in (("timeout_s", timeout_s), ("approval_timeout_s", approval_timeout_s),
                            ("callback_url", callback_url), ("callback_events", callback_events)):
            if value is not None:
                body[name] = value
        headers = {"Idempotency-Key": idempotency_key or str(uuid.uuid4())}
        return Run.from_json(self._request("POST", "/api/v1/runs", body=body, headers=headers, idempotent=True))

    def get(self, run_id: int) -> Run:
        return Run.from_json(self._request("GET", f"/api/v1/runs/{int(run_id)}", idempotent=True))

    def wait(self, run_id: int, *, until: Until = "final", timeout: float = 30.0) -> Run:
        """The run once ``until`` holds (``final``: SUCCEEDED/CLOSED_*,
        ``needs_human``: AWAITING_HITL, ``any``: either), or as it is when
        ``timeout`` seconds passed (check ``run.state``). A final run ends a
        wait for ``needs_human`` too: it can no longer get there."""
        if until not in UNTIL_STATES:
            raise ValueError(f"until must be one of {sorted(UNTIL_STATES)}, not {until!r}")
        wanted = UNTIL_STATES[until]
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            server_wait = min(WAIT_MAX_S, max(0, int(deadline - time.monotonic())))
            started = time.monotonic()
            run = Run.from_json(self._request(
                "GET", f"/api/v1/runs/{int(run_id)}/wait", params={"until": until, "timeout": server_wait},
                timeout=httpx.Timeout(self.timeout + server_wait), idempotent=True,
            ))
            if run.state in wanted or run.final:
                return run
            remaining = deadline - time.monotonic()
            if server_wait == 0 or remaining <= 0:
                return run
            if time.monotonic() - started < server_wait / 2:  # answered early without reaching: do not spin
                time.sleep(min(1.0, remaining))

    def stream(self, run_id: int, *, last_event_id: int | str | None = None) -> Iterator[Event]:
        """The run's events as they happen (from after ``last_event_id``,
        else from its first), until the event of its final state. A dropped
        connection is resumed from the last id received."""
        path = f"/api/v1/runs/{int(run_id)}/stream"
        last_id = None if last_event_id is None else str(last_event_id)
        failures = 0
        while True:
            headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}
            if last_id is not None:
                headers["Last-Event-ID"] = last_id
            try:
                with self._http.stream("GET", path, headers=headers,
                                       timeout=httpx.Timeout(self.timeout, read=STREAM_READ_TIMEOUT_S)) as response:
                    if not response.is_success:
                        response.read()
                        error = ExecGoError.from_response(response)
                        if failures >= self.retries or not (response.status_code >= 500 or error.retryable):
                            raise error
                        failures += 1
                        self._sleep(failures - 1, response.headers.get("Retry-After"))
                        continue
                    for sse_id, sse_type, data in parse_sse(response.iter_lines(), comments=True):
                        if sse_type == ":":
                            # Quiet (a keep-alive): a run already final has no event left to send
                            # (e.g. resumed after its last one), and the server would keep waiting.
                            if self.get(run_id).final:
                                return
                            continue
                        if sse_id is not None:
                            last_id = sse_id
                        try:
                            payload = json.loads(data)
                        except ValueError:
                            payload = {"message": data}
                        event = Event.from_json(payload if isinstance(payload, dict) else {"data": payload},
                                                sse_id=sse_id, sse_type=sse_type)
                        failures = 0
                        yield event
                        if event.final_state:
                            return
            except httpx.TransportError as exc:
                if failures >= self.retries:
                    raise transport_error(exc, "GET", self.base_url + path) from exc
                failures += 1
                self._sleep(failures - 1)
                continue
            # Closed without the final state's event: done if the run is final
            # (its last event came before ``last_event_id``), else resume.
            if self.get(run_id).final:
                return
            if failures >= self.retries:
                raise ExecGoError("external_failure", f"the stream of run {run_id} keeps closing before its end",
                                  retryable=True, source="client", details={"last_event_id": last_id})
            failures += 1
            self._sleep(failures - 1)

    def cancel(self, run_id: int) -> Run:
        """Ask for a cancel (202); applied at the run's next state with a cancel edge. Never retried blindly."""
        return Run.from_json(self._request("POST", f"/api/v1/runs/{int(run_id)}/cancel", idempotent=False))

    def retry(self, run_id: int) -> Run:
        """A new run of a final run's plan (the new run is returned). Never retried blindly."""
        return Run.from_json(self._request("POST", f"/api/v1/runs/{int(run_id)}/retry", idempotent=False))

    def evaluate(self, plan: dict[str, Any]) -> Evaluation:
        """The policy's verdict on a plan, without running it (a read: retried)."""
        return Evaluation.from_json(self._request("POST", "/api/v1/policy/evaluate", body={"plan": plan},
                                                  idempotent=True))

    def approvals(self, status: str | None = "pending") -> list[Approval]:
        """Approval requests of the caller's tenant (``status=None``: all).
        Approvers only: an agent's token gets a 403 ``denied`` error."""
        params = {"status": status} if status else None
        body = self._request("GET", "/api/v1/approvals", params=params, idempotent=True)
        items = body.get("results", []) if isinstance(body, dict) else body
        return [Approval.from_json(item) for item in items]

    # --- transport -------------------------------------------------------

    def _request(self, method: str, path: str, *, idempotent: bool, body: Any = None,
                 params: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
                 timeout: httpx.Timeout | None = None) -> Any:
        """One call with retries (exponential backoff with jitter): connection
        errors, 5xx and ``retryable`` envelopes for idempotent calls; for the
        others only a connection that never opened (nothing was sent)."""
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                response = self._http.request(method, path, json=body, params=params, headers=headers,
                                              timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT)
            except httpx.TransportError as exc:
                if last or not (idempotent or isinstance(exc, _NOT_SENT)):
                    raise transport_error(exc, method, self.base_url + path) from exc
                self._sleep(attempt)
                continue
            if response.is_success:
                return response.json() if response.content else {}
            error = ExecGoError.from_response(response)
            if last or not idempotent or not (response.status_code >= 500 or error.retryable):
                raise error
            self._sleep(attempt, response.headers.get("Retry-After"))
        raise AssertionError("unreachable")

    def _sleep(self, attempt: int, retry_after: str | None = None) -> None:
        delay = min(self.backoff * 2 ** attempt, BACKOFF_MAX_S) * (0.5 + random.random() / 2)
        if retry_after and retry_after.isdigit():
            delay = max(delay, min(float(retry_after), 60.0))
        time.sleep(delay)
