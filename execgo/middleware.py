"""Django's own middleware, with the hooks that do no I/O run on the event
loop under ASGI.

For every request Daphne serves, Django runs each ``MiddlewareMixin``
hook (``process_request``, ``process_response``) in the one thread of
synchronous work (``sync_to_async``): a dozen trips there and back per
request, most of them for hooks that only read or set headers. These
subclasses call such hooks directly. A hook that may reach the database
still goes to the thread: the messages' store, when the request used or
added messages. Under WSGI nothing changes: the hooks run where they
always did.

``settings.MIDDLEWARE`` names these in place of Django's; each behaves as
the class it extends (``tests/execgo/test_middleware.py``). Django's
security, session, CSRF and framing middleware keep their own classes: the
deploy checks look for them by name, and would skip their HTTPS and HSTS
checks, or name a session cookie warning otherwise, for a subclass.
"""

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth import middleware as auth
from django.contrib.messages import middleware as messages
from django.http import HttpResponseForbidden
from django.middleware import common

from execgo.dual import SyncAndAsyncMiddleware


class InlineHooks:
    """The async call of a ``MiddlewareMixin``, with the hooks for which
    ``inline`` says so called on the event loop."""

    def inline(self, hook: str, request) -> bool:
        return True

    async def __acall__(self, request):
        response = None
        if hasattr(self, "process_request"):
            response = await self._call("process_request", request)
        response = response or await self.get_response(request)
        if hasattr(self, "process_response"):
            response = await self._call("process_response", request, response)
        return response

    async def _call(self, hook: str, request, *args):
        method = getattr(self, hook)
        if self.inline(hook, request):
            return method(request, *args)
        return await sync_to_async(method, thread_sensitive=True)(request, *args)


class CommonMiddleware(InlineHooks, common.CommonMiddleware):
    """The slash redirect (a URL resolve) and Content-Length."""


class AuthenticationMiddleware(InlineHooks, auth.AuthenticationMiddleware):
    """``request.user``, lazy: the user is read when a view asks."""


class MessageMiddleware(InlineHooks, messages.MessageMiddleware):
    """The messages' storage at the request; its store at the response only
    when the request used or added messages."""

    def inline(self, hook: str, request) -> bool:
        if hook == "process_request":
            return True
        storage = getattr(request, "_messages", None)
        return storage is None or not (storage.used or storage.added_new)


# A session a decision link opened (EXECGO_DECISION_LINK_SIGN_IN) holds the
# link's path here: it is good for that page only (approvals.views).
LINK_ONLY_SESSION_KEY = "execgo_decision_link_only"


class DecisionLinkSessionMiddleware(SyncAndAsyncMiddleware):
    """A session opened by a one-time decision link answers its link's page
    (and the static files, and logging out) and nothing else: 403 for every
    other page, the admin and the API. The live websocket refuses it too
    (``pages.consumers``).

    Sync and async: under ASGI it stays on the event loop, and a request
    without a session cookie (an API token's) is passed on without touching
    the session; one with a cookie reads its session in the thread of
    synchronous work, once (the session object keeps what it loaded)."""

    def __call__(self, request):
        if self.is_async:
            return self.__acall__(request)
        return self._refusal(request, _link_only(request)) or self.get_response(request)

    async def __acall__(self, request):
        only = await sync_to_async(_link_only)(request) if _has_session_cookie(request) else None
        return self._refusal(request, only) or await self.get_response(request)

    @staticmethod
    def _refusal(request, only):
        if only and request.path != only and not request.path.startswith(("/static/", "/accounts/logout/")):
            return HttpResponseForbidden("This session was opened by a decision link and is good for that one "
                                         "request only. Sign in to see anything else.", content_type="text/plain")
        return None


def _has_session_cookie(request) -> bool:
    return settings.SESSION_COOKIE_NAME in request.COOKIES


def _link_only(request) -> str | None:
    if not hasattr(request, "session") or not _has_session_cookie(request):
        return None
    return request.session.get(LINK_ONLY_SESSION_KEY)
