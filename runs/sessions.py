"""A live page's websocket lasts only as long as what let it open: its
session, its user's password and ``is_active``, the user's tenant and, on
the approvals stream, the approvers group.

Each web process keeps the grants of its own sockets (``SessionWatch``) and
checks all of them in two queries, whatever their number: every
``EXECGO_WS_RECHECK_S`` (the backstop: it sees any change, however it was
made, e.g. a ``QuerySet.update`` in a shell or ``clearsessions``), and at
once when told that a user changed. The telling is the one job of the
receivers at the end of this module: a logout, a save or delete of a user,
a membership, a group membership. They only say "look again" after commit;
what ends a socket is decided here, from the database, never by the signal.
They are signals because the changes come from pages, the admin, the API
and management commands alike, and a signal is the one place that sees
them all.

The telling crosses processes through the default channel layer (Redis in
production, to every web process's watch); on the embedded default's
in-memory layer it reaches this process's own sockets, and a change made in
another process is seen by the next periodic check.

A socket whose grant no longer holds is closed with

- ``4401`` (session ended: logged out, expired, password changed, user
  deactivated or deleted), or
- ``4403`` (access lost: no longer in the socket's tenant, or no longer an
  approver on the approvals stream).

The pages' script then goes through the login page instead of reconnecting
(static/execgo/live.js).
"""

import asyncio
import contextvars
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import import_module

from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.layers import DEFAULT_CHANNEL_LAYER, InMemoryChannelLayer, channel_layers, get_channel_layer
from django.conf import settings
from django.contrib.auth import get_user_model, user_logged_out
from django.contrib.auth.models import Group
from django.contrib.sessions.models import Session
from django.db import transaction
from django.db.models import Exists, F, OuterRef
from django.db.models.signals import m2m_changed, post_delete, post_save
from django.utils import timezone
from django.utils.crypto import constant_time_compare

from approvals.models import APPROVERS_GROUP
from runs.models import Membership

logger = logging.getLogger(__name__)

CLOSE_SESSION_ENDED = 4401
CLOSE_ACCESS_LOST = 4403
# Every web process's watch listens here, on the default channel layer.
SESSIONS_GROUP = "execgo-sessions"
# A channel layer forgets a group membership after its group expiry (a day
# by default): the watch joins again well before.
REJOIN_S = 3600.0
CHUNK = 500  # grants per query


@dataclass(frozen=True)
class SocketGrant:
    """What let a socket open. ``auth_hash`` is the user's session auth
    hash then (it changes with the password)."""

    user_id: int
    session_key: str
    auth_hash: str
    tenant_id: int
    needs_approver: bool


def grant_for(user, session_key: str, *, tenant_id: int, needs_approver: bool) -> SocketGrant:
    return SocketGrant(user_id=user.pk, session_key=session_key, auth_hash=user.get_session_auth_hash(),
                       tenant_id=tenant_id, needs_approver=needs_approver)


def _live_sessions(keys: set[str]) -> set[str]:
    if settings.SESSION_ENGINE == "django.contrib.sessions.backends.db":
        return set(Session.objects.filter(session_key__in=keys, expire_date__gt=timezone.now())
                   .values_list("session_key", flat=True))
    store = import_module(settings.SESSION_ENGINE).SessionStore
    return {key for key in keys if store().exists(key)}


def verdicts(grants: list[SocketGrant]) -> list[int | None]:
    """For each grant, the close code its socket must get, or None while it
    holds. Two queries per ``CHUNK`` grants."""
    if not grants:
        return []
    User = get_user_model()
    sessions, users = set(), {}
    for at in range(0, len(grants), CHUNK):
        chunk = grants[at:at + CHUNK]
        sessions |= _live_sessions({grant.session_key for grant in chunk})
        approver = Exists(User.groups.through.objects.filter(user_id=OuterRef("pk"), group__name=APPROVERS_GROUP))
        for row in (User.objects.filter(pk__in={grant.user_id for grant in chunk})
                    .annotate(tenant=F("membership__tenant_id"), approver=approver)
                    .values("pk", "password", "is_active", "tenant", "approver")):
            row["auth_hash"] = User(password=row["password"]).get_session_auth_hash()  # once per user
            users[row["pk"]] = row
    outcome = []
    for grant in grants:
        row = users.get(grant.user_id)
        if (row is None or not row["is_active"] or grant.session_key not in sessions
                or not constant_time_compare(row["auth_hash"], grant.auth_hash)):
            outcome.append(CLOSE_SESSION_ENDED)
        elif row["tenant"] != grant.tenant_id or (grant.needs_approver and not row["approver"]):
            outcome.append(CLOSE_ACCESS_LOST)
        else:
            outcome.append(None)
    return outcome


class SessionWatch:
    """This process's sockets' grants, checked together (see the module
    docstring). A socket registers after its handshake and is sent
    ``{"type": "session.end", "code": ...}`` on the relay layer when its
    grant stops holding."""

    def __init__(self) -> None:
        self.grants: dict[str, SocketGrant] = {}  # by the socket's channel name
        self.checks = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._wake: asyncio.Event | None = None
        self._changed: set[int] | None = set()  # users told about since the last check; None: everyone

    async def ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop and all(not task.done() for task in self._tasks):
            return
        for task in self._tasks:
            task.cancel()
        self._loop, self._wake = loop, asyncio.Event()
        # A fresh context: the watch outlives the request that started it.
        self._tasks = [loop.create_task(self._check_forever(), name="execgo-session-watch",
                                        context=contextvars.Context()),
                       loop.create_task(self._listen_forever(), name="execgo-session-listen",
                                        context=contextvars.Context())]

    def register(self, channel_name: str, grant: SocketGrant) -> None:
        self.grants[channel_name] = grant

    def unregister(self, channel_name: str) -> None:
        self.grants.pop(channel_name, None)

    def told(self, user_ids: list[int] | None) -> None:
        if user_ids is None or self._changed is None:
            self._changed = None
        else:
            self._changed.update(user_ids)
        if self._wake is not None:
            self._wake.set()

    async def _check_forever(self) -> None:
        from runs.relay import RELAY_LAYER

        layer = get_channel_layer(RELAY_LAYER)
        loop = asyncio.get_running_loop()
        # The periodic check of every socket is due on its own clock: however
        # often the watch is woken for some users, it still sees what no
        # signal announces (an expired session, a ``QuerySet.update``).
        every_due = loop.time() + settings.EXECGO_WS_RECHECK_S
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), max(every_due - loop.time(), 0.0))
            except TimeoutError:
                pass
            self._wake.clear()
            only, self._changed = self._changed, set()  # the users told about; None: everyone
            if loop.time() >= every_due:
                only = None
            if only is None:
                every_due = loop.time() + settings.EXECGO_WS_RECHECK_S
            try:
                await self.check(layer, only)
            except Exception:  # never the end of the watch: the next check tries again
                logger.warning("the websockets' session check failed", exc_info=True)

    async def check(self, layer, only: set[int] | None = None) -> None:
        pending = [(name, grant) for name, grant in self.grants.items() if only is None or grant.user_id in only]
        if not pending:
            return
        try:
            codes = await database_sync_to_async(verdicts, thread_sensitive=False)([g for _, g in pending])
        except Exception:  # a database outage: the sockets stay until a check can be made
            logger.warning("the websockets' session check failed", exc_info=True)
            return
        self.checks += 1
        for (name, grant), code in zip(pending, codes, strict=True):
            if code is None or self.grants.pop(name, None) is None:
                continue
            try:
                await layer.send(name, {"type": "session.end", "code": code})
            except Exception:  # e.g. the socket's channel is full: kept, and closed by the next check
                self.grants.setdefault(name, grant)
                logger.warning("could not end a websocket whose session ended", exc_info=True)

    async def _listen_forever(self) -> None:
        layer = get_channel_layer()
        while True:
            try:
                channel = await layer.new_channel("execgo-sessions.")
                while True:
                    await layer.group_add(SESSIONS_GROUP, channel)
                    try:
                        message = await asyncio.wait_for(layer.receive(channel), REJOIN_S)
                    except TimeoutError:
                        continue
                    self.told(message.get("user_ids"))
            except asyncio.CancelledError:
                raise
            except Exception:  # e.g. Redis is away: the periodic check still runs
                logger.warning("the session watch lost its channel layer; listening again in 1 s", exc_info=True)
                await asyncio.sleep(1.0)


session_watch = SessionWatch()


# --- Telling every web process that users changed -------------------------------

BROADCAST_TIMEOUT_S = 2.0


async def _broadcast(user_ids: list[int] | None) -> None:
    # A layer of this call's own: its connections belong to this call's event
    # loop (async_to_sync may have made one) and are closed with it.
    own = channel_layers.make_backend(DEFAULT_CHANNEL_LAYER)
    try:
        await asyncio.wait_for(own.group_send(SESSIONS_GROUP, {"type": "session.changed", "user_ids": user_ids}),
                               BROADCAST_TIMEOUT_S)
    finally:
        close = getattr(own, "close_pools", None)
        if close is not None:
            await close()


def _tell_now(user_ids: list[int] | None) -> None:
    loop = session_watch._loop
    if loop is not None and not loop.is_closed():
        # This process's own sockets, whatever the layer.
        loop.call_soon_threadsafe(session_watch.told, user_ids)
    if isinstance(get_channel_layer(), InMemoryChannelLayer):
        return  # no other process hears an in-memory layer: their periodic check will see it
    run_to_its_end(_broadcast, user_ids)


def run_to_its_end(async_function, *args):
    """``async_function(*args)`` awaited from synchronous code. A thread
    whose own event loop runs (e.g. a test driving a browser) cannot wait on
    a coroutine with ``async_to_sync``: it is run from another thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return async_to_sync(async_function)(*args)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, async_function(*args)).result()


def users_changed(user_ids: list[int] | None) -> None:
    """After commit, tell every web process's watch to check these users'
    sockets (None: everyone's). Never fails the change itself."""

    def tell() -> None:
        try:
            _tell_now(user_ids)
        except Exception:
            logger.warning("could not tell the web processes about a session change; "
                           "their periodic check will see it", exc_info=True)

    transaction.on_commit(tell)


def _on_logout(sender, request, user, **kwargs) -> None:
    if user is not None:
        users_changed([user.pk])


def _on_user(sender, instance, **kwargs) -> None:
    users_changed([instance.pk])


def _on_membership(sender, instance, **kwargs) -> None:
    users_changed([instance.user_id])


def _on_groups(sender, instance, action, reverse, pk_set, **kwargs) -> None:
    if not action.startswith("post_"):
        return
    if not reverse:
        users_changed([instance.pk])  # a user's groups
    else:
        users_changed(sorted(pk_set) if pk_set is not None else None)  # a group's users; a clear: everyone


def _on_group_deleted(sender, instance, **kwargs) -> None:
    users_changed(None)


def connect_signals() -> None:
    User = get_user_model()
    user_logged_out.connect(_on_logout, dispatch_uid="execgo-ws-logout")
    post_save.connect(_on_user, sender=User, dispatch_uid="execgo-ws-user-saved")
    post_delete.connect(_on_user, sender=User, dispatch_uid="execgo-ws-user-deleted")
    post_save.connect(_on_membership, sender=Membership, dispatch_uid="execgo-ws-membership-saved")
    post_delete.connect(_on_membership, sender=Membership, dispatch_uid="execgo-ws-membership-deleted")
    m2m_changed.connect(_on_groups, sender=User.groups.through, dispatch_uid="execgo-ws-groups")
    post_delete.connect(_on_group_deleted, sender=Group, dispatch_uid="execgo-ws-group-deleted")
