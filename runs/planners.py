"""PLANNING: turn a run's request into a validated plan.

``static`` (default) takes the agent's plan as it is; ``llm`` asks an
OpenAI-compatible chat-completions endpoint to turn the run's goal into a
plan in the same schema. Both end in ``validate_plan``.

The llm planner, configured by settings (read at call time):

- ``EXECGO_LLM_URL``: base URL of the API; each attempt is one POST to
  ``<url>/chat/completions``. Empty: every llm run fails in PLANNING.
- ``EXECGO_LLM_MODEL``: sent as ``model``; empty lets the server choose.
- ``EXECGO_LLM_API_KEY``: sent as ``Authorization: Bearer``; it never
  reaches a log line, a trace or an error message.
- ``EXECGO_LLM_TIMEOUT_S`` (30), ``EXECGO_LLM_RETRIES`` (2),
  ``EXECGO_LLM_BACKOFF_S`` (0.5, doubled after each attempt).

Which failure takes which edge:

- connection errors, 429 and 5xx are retried with exponential backoff;
  when the retries run out, FAILED with a retryable ``external_failure``;
- any other HTTP status, or a body that is not a chat completion, or a
  reply that is not JSON: FAILED at once with a non-retryable
  ``external_failure``. At temperature 0 asking again would get the same
  answer;
- a reply that is JSON but not a valid plan: FAILED (``invalid_input``);
- a call that exceeds ``EXECGO_LLM_TIMEOUT_S``: TIMEOUT at once, not
  retried (the PLANNING → TIMEOUT edge of
  docs/state-machine.md#legal-transitions). Not
  retrying keeps planning within (retries + 1) × timeout plus the
  backoffs, 91.5 s with the defaults, which must stay under the PLANNING
  zombie threshold (180 s) or the sweeper times the run out first. The
  timeout covers connecting, waiting for the answer and reading it: the
  socket timeout bounds each blocking operation and a deadline is checked
  between reads, so a response that trickles in is cut off too (at worst
  one socket timeout past the deadline).
"""

import http.client
import json
import logging
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from runs.errors import ErrorCode, ExecGoError, error_envelope
from runs.models import Run
from runs.plan_schema import KNOWN_TOOLS, MAX_RETRIES, validate_plan

logger = logging.getLogger(__name__)

RAW_RESPONSE_TRACE_BYTES = 2048
MAX_RESPONSE_BYTES = 1024 * 1024
READ_CHUNK_BYTES = 64 * 1024
_NOT_JSON = object()
_FENCED_JSON = re.compile(r"```(?:json)?[ \t]*\n?(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclass
class PlanningFailed(Exception):
    """The planner could not produce a valid plan; ``timed_out`` selects
    the TIMEOUT edge instead of FAILED."""

    envelope: dict
    timed_out: bool = False
    trace_data: dict = field(default_factory=dict)


def plan_run(run: Run) -> tuple[list[dict], dict]:
    """Return (normalised steps in dependency order, trace data)."""
    if run.planner == "llm":
        return _plan_with_llm(run)
    if run.planner != "static":
        raise PlanningFailed(_envelope(ErrorCode.INVALID_INPUT, f"unknown planner {run.planner!r}"),
                             trace_data={"planner": run.planner})
    try:
        return validate_plan(run.plan), {"planner": "static"}
    except ExecGoError as exc:
        raise PlanningFailed(exc.envelope, trace_data={"planner": "static"}) from None


def _envelope(code: str, message: str, *, retryable: bool | None = None, **details: Any) -> dict:
    return error_envelope(code, message, source="scheduler", retryable=retryable, details=details)


@dataclass(frozen=True)
class LlmSettings:
    url: str
    model: str
    api_key: str = field(repr=False)
    timeout_s: float
    retries: int
    backoff_s: float

    @classmethod
    def load(cls) -> "LlmSettings":
        return cls(
            url=settings.EXECGO_LLM_URL.rstrip("/"),
            model=settings.EXECGO_LLM_MODEL,
            api_key=settings.EXECGO_LLM_API_KEY,
            timeout_s=settings.EXECGO_LLM_TIMEOUT_S,
            retries=max(settings.EXECGO_LLM_RETRIES, 0),
            backoff_s=max(settings.EXECGO_LLM_BACKOFF_S, 0.0),
        )

    def redact(self, text: str) -> str:
        # An endpoint that echoes the request must not smuggle the key into a trace.
        return text.replace(self.api_key, "[redacted]") if self.api_key else text


_TOOL_PARAMS = {
    "shell": 'params {"argv": ["program", "arg", ...]} (run directly, no shell) or {"script": "..."} '
             "(run by /bin/sh -c); exactly one of the two",
    "http": 'params {"method": "GET", "url": "https://...", "headers": {...}, "body": "...", "timeout_s": 10, "follow_redirects": 0}; '
            "only url is required",
    "file": 'params {"op": "read" | "write" | "list", "path": "relative/path", "content": "..."}; '
            "paths are relative to the step's workspace, content is for write only",
}


def _system_prompt(tools: list[str]) -> str:
    tool_lines = "\n".join(f'- "{tool}": {_TOOL_PARAMS[tool]}' for tool in tools if tool in _TOOL_PARAMS)
    return f"""You are the planner of an execution harness. Turn the user's goal into a plan of tool calls.
Answer with one JSON object and nothing else, in this schema:
{{"steps": [{{"id": "short-unique-id", "tool": "<tool>", "params": {{...}}, "depends_on": ["<earlier step id>"],
"timeout_s": 60, "retries": 0}}]}}
Rules:
- "id", "tool" and "params" are required; "depends_on", "timeout_s" and "retries" are optional.
- Step ids are unique. "depends_on" lists ids of other steps that must succeed first; no cycles.
- At most {settings.EXECGO_MAX_PLAN_STEPS} steps. "timeout_s" is seconds in (0, 86400]; "retries" an integer
  from 0 to {MAX_RETRIES}.
- No other keys, at the top level or in a step.
Tools available:
{tool_lines}
Example: {{"steps": [{{"id": "list", "tool": "shell", "params": {{"argv": ["ls", "-l"]}}}},
{{"id": "count", "tool": "shell", "params": {{"script": "ls | wc -l"}}, "depends_on": ["list"]}}]}}"""


def _request_body(run: Run, config: LlmSettings) -> bytes:
    tools = [tool for tool in (run.context or {}).get("tools", KNOWN_TOOLS) if tool in KNOWN_TOOLS]
    body: dict[str, Any] = {
        "messages": [
            {"role": "system", "content": _system_prompt(tools or list(KNOWN_TOOLS))},
            {"role": "user", "content": run.goal},
        ],
        "response_format": {"type": "json_object"},
        "temperature": 0,
    }
    if config.model:
        body["model"] = config.model
    return json.dumps(body).encode()


@dataclass
class _Answer:
    """What one attempt got back: an HTTP status and body, or no answer."""

    status: int | None = None
    body: bytes = b""
    timed_out: bool = False
    connection_error: str = ""


def _call(url: str, payload: bytes, headers: dict[str, str], timeout_s: float) -> _Answer:
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(url, data=payload, headers=headers, method="POST")
    try:
        response = urllib.request.urlopen(request, timeout=timeout_s)
    except urllib.error.HTTPError as error:  # an answer, with a status worth recording
        try:
            body = error.read(MAX_RESPONSE_BYTES)
        except (OSError, http.client.HTTPException):
            body = b""
        finally:
            error.close()
        return _Answer(status=error.code, body=body)
    except (OSError, http.client.HTTPException) as error:  # URLError and TimeoutError are OSErrors
        return _failure_answer(error)
    try:
        with response:
            chunks, size = [], 0
            # read1 returns after one socket read, so the deadline is checked
            # however slowly the body arrives; read(n) would wait for n bytes.
            while chunk := response.read1(READ_CHUNK_BYTES):
                chunks.append(chunk)
                size += len(chunk)
                if time.monotonic() > deadline:
                    return _Answer(timed_out=True)
                if size > MAX_RESPONSE_BYTES:
                    return _Answer(status=response.status, body=b"".join(chunks)[:MAX_RESPONSE_BYTES])
            return _Answer(status=response.status, body=b"".join(chunks))
    except (OSError, http.client.HTTPException) as error:
        return _failure_answer(error)


def _failure_answer(error: Exception) -> _Answer:
    reason = error.reason if isinstance(error, urllib.error.URLError) else error
    if isinstance(reason, TimeoutError):
        return _Answer(timed_out=True)
    return _Answer(connection_error=f"{type(reason).__name__}: {reason}")


def _is_transient(status: int) -> bool:
    return status == 429 or 500 <= status <= 599


def _headers(config: LlmSettings) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    return headers


def _plan_with_llm(run: Run) -> tuple[list[dict], dict]:
    config = LlmSettings.load()
    trace: dict[str, Any] = {"planner": "llm", "model": config.model, "attempts": []}
    if not config.url:
        raise PlanningFailed(_envelope(ErrorCode.INTERNAL, "the llm planner is not configured: set EXECGO_LLM_URL",
                                       retryable=False), trace_data=trace)
    if not run.goal.strip():
        raise PlanningFailed(_envelope(ErrorCode.INVALID_INPUT, "the llm planner needs a goal; this run has none"),
                             trace_data=trace)

    url, payload, headers = f"{config.url}/chat/completions", _request_body(run, config), _headers(config)

    attempts = config.retries + 1
    last_problem = ""
    for attempt in range(1, attempts + 1):
        if attempt > 1:
            backoff = config.backoff_s * 2 ** (attempt - 2)
            logger.info("run %s: planner attempt %d failed (%s); retrying in %.2fs",
                        run.pk, attempt - 1, last_problem, backoff)
            time.sleep(backoff)
        started = time.monotonic()
        answer = _call(url, payload, headers, config.timeout_s)
        record: dict[str, Any] = {"attempt": attempt, "latency_ms": round((time.monotonic() - started) * 1000, 1)}
        trace["attempts"].append(record)

        if answer.timed_out:
            record["outcome"] = "timeout"
            raise PlanningFailed(
                _envelope(ErrorCode.TIMEOUT, f"planner call exceeded its timeout of {config.timeout_s:g}s",
                          retryable=True, timeout_ms=int(config.timeout_s * 1000), attempt=attempt),
                timed_out=True, trace_data=trace,
            )
        if answer.status is None:
            record["outcome"] = "connection_error"
            last_problem = record["error"] = config.redact(answer.connection_error)
            continue
        record["http_status"] = answer.status
        trace["raw_response"] = config.redact(answer.body[:RAW_RESPONSE_TRACE_BYTES].decode("utf-8", "replace"))
        trace["raw_response_bytes"] = len(answer.body)
        if _is_transient(answer.status):
            record["outcome"] = "retryable_status"
            last_problem = f"HTTP {answer.status}"
            continue
        if not 200 <= answer.status <= 299:
            record["outcome"] = "http_error"
            raise PlanningFailed(_envelope(ErrorCode.EXTERNAL_FAILURE,
                                           f"planner endpoint answered HTTP {answer.status}", retryable=False,
                                           http_status=answer.status), trace_data=trace)
        record["outcome"] = "answered"
        steps = _steps_from_completion(answer.body, trace)
        return steps, trace

    raise PlanningFailed(
        _envelope(ErrorCode.EXTERNAL_FAILURE, f"planner endpoint failed {attempts} time(s); last: {last_problem}",
                  retryable=True, attempts=attempts),
        trace_data=trace,
    )


def _steps_from_completion(body: bytes, trace: dict) -> list[dict]:
    try:
        completion = json.loads(body)
        content = completion["choices"][0]["message"]["content"]
        if not isinstance(content, str):
            raise TypeError("content is not a string")
    except (ValueError, LookupError, TypeError):
        raise PlanningFailed(_envelope(ErrorCode.EXTERNAL_FAILURE,
                                       "planner endpoint did not answer with a chat completion", retryable=False),
                             trace_data=trace) from None
    if isinstance(completion.get("usage"), dict):
        trace["usage"] = completion["usage"]
    plan = _json_in(content)
    if plan is _NOT_JSON:
        raise PlanningFailed(_envelope(ErrorCode.EXTERNAL_FAILURE, "planner reply is not JSON", retryable=False),
                             trace_data=trace)
    try:
        return validate_plan(plan)
    except ExecGoError as exc:
        envelope = {**exc.envelope, "message": f"the llm planner's plan is invalid: {exc.envelope['message']}"}
        raise PlanningFailed(envelope, trace_data=trace) from None


def _json_in(content: str) -> Any:
    """The reply as JSON, or the first fenced block in it that is JSON;
    ``_NOT_JSON`` when there is neither."""
    candidates = [content, *(match.group(1) for match in _FENCED_JSON.finditer(content))]
    for candidate in candidates:
        try:
            return json.loads(candidate)
        except ValueError:
            continue
    return _NOT_JSON
