"""The API's waiting views, async so a waiting client holds no thread:
``runs/{id}/wait`` returns when the run reaches a kind of state (or at the
timeout), ``runs/{id}/stream`` is one SSE event per outbox row. Both are
woken by this web process's outbox relay (runs/relay.py), not by a
sleep loop per request.

They are Channels HTTP consumers routed before Django's middleware
(execgo/asgi.py): Django runs each request's middleware in a thread of that
request's own, so a waiting view behind it would still hold a thread per
client. They authenticate like the rest of the API (a token, or the session
through Channels' AuthMiddlewareStack) and answer errors with the same
envelope.
"""

import asyncio
import json
import logging
import math
import time
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.http import AsyncHttpConsumer
from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder

from runs.api.serializers import RunSerializer
from runs.errors import ErrorCode, error_envelope
from runs.models import Event, EventType, Run
from runs.relay import event_payload, relay
from runs.selectors import LIVE_EVENT_FIELDS, runs_for_user
from runs.sessions import grant_for, verdicts
from runs.statemachine import FINAL, RunState
from runs.tokens import token_authenticate

logger = logging.getLogger(__name__)


def _db(func):
    """``func`` on the loop's bounded thread pool. Django gives every request
    its own thread for thread-sensitive calls, kept while the request lasts:
    a waiting client would hold one each."""
    return database_sync_to_async(func, thread_sensitive=False)


KEEP_ALIVE_S = 15.0
UNTIL = {
    "final": FINAL,
    "needs_human": frozenset({RunState.AWAITING_HITL}),
    "any": FINAL | {RunState.AWAITING_HITL},
}
STREAM_BACKLOG = 1000  # events read per page of a replay
MAX_EVENT_ID = 2**63 - 1  # a bigint


class _Refused(Exception):
    def __init__(self, code: str, message: str, status: int, *, headers=(), **details) -> None:
        super().__init__(message)
        self.status = status
        self.headers = list(headers)
        self.body = {"error": error_envelope(code, message, source="api", details=details)}


def _user_for_token(key: str):
    token = token_authenticate(key)  # refuses a NUL, say, before the database sees it
    return token.user if token is not None else None


def _headers(scope) -> dict[str, str]:
    return {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope.get("headers", [])}


async def _authenticate(scope):
    header = _headers(scope).get("authorization", "")
    if header.startswith("Token "):
        user = await _db(_user_for_token)(header[len("Token "):].strip())
    else:
        user = scope.get("user")  # the session, through AuthMiddlewareStack
    if user is None or not user.is_authenticated:
        raise _Refused(ErrorCode.DENIED, "authentication credentials were not provided or are invalid", 401)
    return user


def _credential(scope, user, run_id: int):
    """What let this request in, to check again while a stream lasts: the
    token's key, or the session's grant (runs.sessions)."""
    header = _headers(scope).get("authorization", "")
    if header.startswith("Token "):
        return ("token", header[len("Token "):].strip())
    session = scope.get("session")
    run = Run.objects.filter(pk=run_id).values_list("tenant_id", flat=True).get()
    return ("session", grant_for(user, session.session_key if session else "", tenant_id=run, needs_approver=False))


def _still_allowed(credential, run_id: int) -> bool:
    """The credential still holds and still reaches the run: the token is not
    revoked or expired and its user active and of the run's tenant; the
    session not ended, its password unchanged, its user active and of the
    run's tenant."""
    kind, value = credential
    if kind == "token":
        token = token_authenticate(value)
        return token is not None and _run_of(token.user, run_id) is not None
    return verdicts([value])[0] is None


def _json(body: dict) -> bytes:
    return json.dumps(body, cls=DjangoJSONEncoder).encode()


class _ApiConsumer(AsyncHttpConsumer):
    """A GET-only endpoint answering errors with the API's envelope."""

    async def handle(self, body: bytes) -> None:
        try:
            if self.scope["method"] != "GET":
                raise _Refused(ErrorCode.INVALID_INPUT, f"method {self.scope['method']} not allowed", 405,
                               headers=[(b"Allow", b"GET")])
            query = {key: values[-1] for key, values in
                     parse_qs(self.scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True).items()}
            await self.respond(await _authenticate(self.scope), int(self.scope["url_route"]["kwargs"]["run_id"]),
                               query)
        except _Refused as refused:
            await self._send_error(refused)
        except Exception:
            if self._headers_sent:
                raise  # mid-stream: nothing but closing is left
            logger.exception("unhandled API error")
            await self._send_error(_Refused(ErrorCode.INTERNAL, "internal error", 500))

    _headers_sent = False

    async def send_headers(self, *args, **kwargs):
        self._headers_sent = True
        await super().send_headers(*args, **kwargs)

    async def _send_error(self, refused: _Refused) -> None:
        if refused.status == 500:
            refused.body["error"]["retryable"] = False  # a bug: the same request fails the same way
        await self.send_response(refused.status, _json(refused.body),
                                 headers=[(b"Content-Type", b"application/json"), *refused.headers])


def _run_of(user, run_id: int) -> Run | None:
    return runs_for_user(user).filter(pk=run_id).first()


def _run_body(run_id: int) -> dict:
    run = Run.objects.prefetch_related("steps").get(pk=run_id)
    return RunSerializer(run).data


class RunWaitConsumer(_ApiConsumer):
    """``GET /api/v1/runs/{id}/wait?until=final|needs_human|any&timeout=<s>``:
    the run once it is in that kind of state (``reached: true``), or as it
    is at the timeout (``reached: false``)."""

    async def respond(self, user, run_id: int, query: dict) -> None:
        until = query.get("until", "final")
        if until not in UNTIL:
            raise _Refused(ErrorCode.INVALID_INPUT, f"until must be one of {', '.join(UNTIL)}", 400, until=until)
        try:
            timeout = float(query.get("timeout", "30"))
        except ValueError:
            timeout = math.nan
        if not math.isfinite(timeout) or timeout < 0:
            raise _Refused(ErrorCode.INVALID_INPUT, "timeout must be a non-negative number of seconds", 400)
        timeout = min(timeout, settings.EXECGO_API_WAIT_MAX_S)
        if await _db(_run_of)(user, run_id) is None:
            raise _Refused(ErrorCode.NOT_FOUND, f"no run {run_id}", 404)
        await relay.ensure_started()
        deadline = time.monotonic() + timeout
        # Subscribed before the state is read: a change committed in between
        # still wakes us.
        with relay.subscription(run_id) as events:
            while True:
                state = await _db(_state_of)(run_id)
                reached = state in UNTIL[until]
                remaining = deadline - time.monotonic()
                if reached or remaining <= 0 or state in FINAL:  # a final run reaches nothing more
                    break
                try:
                    await asyncio.wait_for(events.get(), remaining)
                except TimeoutError:
                    pass
        body = await _db(_run_body)(run_id)
        await self.send_response(200, _json({**body, "reached": reached}),
                                 headers=[(b"Content-Type", b"application/json")])


def _state_of(run_id: int) -> str:
    return Run.objects.filter(pk=run_id).values_list("state", flat=True).get()


def _backlog(run_id: int, after: int, upto: int) -> list[dict]:
    return list(Event.objects.filter(run_id=run_id, pk__gt=after, pk__lte=upto).order_by("pk")
                .values(*LIVE_EVENT_FIELDS)
                [:STREAM_BACKLOG])


def _nothing_left(run_id: int, after: int) -> bool:
    return (Run.objects.filter(pk=run_id, state__in=FINAL).exists()
            and not Event.objects.filter(run_id=run_id, pk__gt=after).exists())


def _sse(event: dict) -> str:
    return f"id: {event['id']}\nevent: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


def _ends(event: dict) -> bool:
    return event["type"] == EventType.RUN_STATE_CHANGED and event["data"].get("to") in FINAL


# The last event of a stream whose token or session stopped holding
# (revoked, expired, logged out, user deactivated or moved to another tenant).
_ENDED = b'event: access_lost\ndata: {"reason": "the credentials of this stream no longer hold"}\n\n'


class RunStreamConsumer(_ApiConsumer):
    """``GET /api/v1/runs/{id}/stream``: Server-Sent Events, one per outbox
    row of the run, from ``Last-Event-ID`` (or ``?last_event_id=``) on;
    ``: keep-alive`` comments while quiet; closes after the final state, or
    with an ``access_lost`` event once its credentials stop holding (checked
    every ``EXECGO_WS_RECHECK_S``)."""

    async def respond(self, user, run_id: int, query: dict) -> None:
        raw = _headers(self.scope).get("last-event-id") or query.get("last_event_id", "0")
        if not raw.isascii() or not raw.isdigit() or len(raw) > 19 or int(raw) > MAX_EVENT_ID:
            raise _Refused(ErrorCode.INVALID_INPUT, "Last-Event-ID must be an event id", 400)
        last = int(raw)
        if await _db(_run_of)(user, run_id) is None:
            raise _Refused(ErrorCode.NOT_FOUND, f"no run {run_id}", 404)
        credential = await _db(_credential)(self.scope, user, run_id)
        await relay.ensure_started()
        await self.send_headers(status=200, headers=[(b"Content-Type", b"text/event-stream"),
                                                     (b"Cache-Control", b"no-store"), (b"X-Accel-Buffering", b"no")])
        with relay.subscription(run_id) as live:
            upto = relay.cursor
            while page := await _db(_backlog)(run_id, last, upto):
                for event in page:
                    payload = event_payload(event)
                    await self.send_body(_sse(payload).encode(), more_body=True)
                    if _ends(payload):
                        return await self.send_body(b"")
                last = page[-1]["id"]
            last = max(last, upto)
            if await _db(_nothing_left)(run_id, last):
                return await self.send_body(b"")  # final, and its last event is behind the client
            recheck_s = settings.EXECGO_WS_RECHECK_S
            checked = sent = time.monotonic()
            while True:
                try:
                    event = await asyncio.wait_for(live.get(), max(0.0, checked + recheck_s - time.monotonic()))
                except TimeoutError:
                    event = None
                now = time.monotonic()
                if now - checked >= recheck_s:
                    # The stream lasts only as long as what let it open.
                    if not await _db(_still_allowed)(credential, run_id):
                        return await self.send_body(_ENDED)
                    checked = now
                if event is None:
                    if now - sent >= KEEP_ALIVE_S:
                        await self.send_body(b": keep-alive\n\n", more_body=True)
                        sent = now
                    continue
                sent = now
                if event["id"] <= last:
                    continue
                last = event["id"]
                await self.send_body(_sse(event).encode(), more_body=not _ends(event))
                if _ends(event):
                    return
