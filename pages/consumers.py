"""The one websocket of the pages: authenticate, join the scope's groups,
send what the client missed, then forward the relay's events.

``/ws/live/?scope=runs|run|approvals[&run=<id>]&after=<event id>``: a
client sends the id of the last event it has (the page embeds the id it was
rendered at). The backlog is read from the database up to the relay's
cursor and the live stream is everything after it, so a reconnecting
client gets every event once, in order.

A socket lasts as long as its session and its user's access: the process's
session watch (runs/sessions.py) closes it with 4401 or 4403 within
about ``EXECGO_WS_RECHECK_S`` of a logout, a password change, a
deactivation, a change of tenant or, on the approvals stream, a removal
from the approvers group.
"""

from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from execgo.middleware import LINK_ONLY_SESSION_KEY
from runs.relay import RELAY_LAYER, approvals_group, event_payload, relay, run_group, runs_group
from runs.selectors import events_for_live_scope, run_in_tenant, tenant_of
from runs.sessions import grant_for, session_watch, verdicts

# Past this many missed events a client reloads the page instead.
BACKLOG_LIMIT = 2000
SCOPES = ("runs", "run", "approvals")


class LiveConsumer(AsyncJsonWebsocketConsumer):
    channel_layer_alias = RELAY_LAYER

    async def connect(self) -> None:
        user = self.scope.get("user")
        params = parse_qs(self.scope.get("query_string", b"").decode())
        scope = (params.get("scope") or ["runs"])[0]
        try:
            after = max(int((params.get("after") or ["0"])[0]), 0)
            run_id = int(params["run"][0]) if scope == "run" else None
        except (KeyError, ValueError):
            await self.close()
            return
        if user is None or not user.is_authenticated or scope not in SCOPES:
            await self.close()  # before accept: the handshake is refused (403)
            return
        tenant = await database_sync_to_async(tenant_of)(user)
        if tenant is None or (run_id is not None and not await database_sync_to_async(run_in_tenant)(run_id, tenant.pk)):
            await self.close()
            return
        session = self.scope.get("session")
        if session is None or not session.session_key or await database_sync_to_async(session.get)(
                LINK_ONLY_SESSION_KEY):
            await self.close()  # no session, or one a decision link opened (good for that link's page only)
            return
        grant = grant_for(user, session.session_key, tenant_id=tenant.pk, needs_approver=scope == "approvals")
        if (await database_sync_to_async(verdicts)([grant]))[0] is not None:
            await self.close()  # e.g. the approvals stream of someone who is not an approver
            return
        self.last_sent = after
        group = {"runs": runs_group, "approvals": approvals_group}.get(scope)
        self.group = run_group(run_id) if scope == "run" else group(tenant.pk)
        # Join first, then read the relay's cursor: whatever it sends from
        # here on reaches us, and what it sent before is in the backlog.
        await self.channel_layer.group_add(self.group, self.channel_name)
        await relay.ensure_started()
        upto = relay.cursor
        await self.accept()
        # After the handshake: a grant that stops holding from here on ends
        # with a close code the page's script can read.
        await session_watch.ensure_started()
        session_watch.register(self.channel_name, grant)
        rows = await database_sync_to_async(events_for_live_scope)(
            scope, tenant_id=tenant.pk, run_id=run_id, after=after, upto=upto, limit=BACKLOG_LIMIT + 1)
        if len(rows) > BACKLOG_LIMIT:
            await self.send_json({"type": "resync", "reason": f"more than {BACKLOG_LIMIT} events missed"})
            await self.close()
            return
        for row in rows:
            await self.send_json({"type": "event", "event": event_payload(row)})
        self.last_sent = max(after, upto)
        await self.send_json({"type": "ready", "cursor": self.last_sent})

    async def disconnect(self, code) -> None:
        session_watch.unregister(self.channel_name)
        if hasattr(self, "group"):
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive_json(self, content, **kwargs) -> None:
        pass  # the stream is one-way; a client says what it has by reconnecting with ``after``

    async def relay_event(self, message) -> None:
        event = message["event"]
        if event["id"] <= self.last_sent:
            return  # also in the backlog this client was sent
        self.last_sent = event["id"]
        await self.send_json({"type": "event", "event": event})

    async def session_end(self, message) -> None:
        await self.close(code=message["code"])
