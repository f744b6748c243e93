"""The one websocket of the pages: authenticate, join the scope's groups,
send what the client missed, then forward the relay's events.

``/ws/live/?scope=runs|run|approvals[&run=<id>]&after=<event id>``: a
client sends the id of the last event it has (the page embeds the id it was
rendered at). The backlog is read from the database up to the relay's
cursor and the live stream is everything after it, so a reconnecting
client gets every event once, in order.
"""

from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from runs.selectors import events_for_live_scope, run_in_tenant, tenant_of
from runs.web.relay import RELAY_LAYER, approvals_group, event_payload, relay, run_group, runs_group

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
        self.last_sent = after
        group = {"runs": runs_group, "approvals": approvals_group}.get(scope)
        self.group = run_group(run_id) if scope == "run" else group(tenant.pk)
        # Join first, then read the relay's cursor: whatever it sends from
        # here on reaches us, and what it sent before is in the backlog.
        await self.channel_layer.group_add(self.group, self.channel_name)
        await relay.ensure_started()
        upto = relay.cursor
        await self.accept()
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
