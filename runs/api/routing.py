"""The API's waiting endpoints, routed before Django's middleware (see
runs/api/live.py); the session reaches them through AuthMiddlewareStack.

Also the one thing the API needs from the HTTP server itself: Twisted,
under Daphne, parses a POSTed form body into ``request.args`` before the
application sees it (Daphne never reads them) and answers a multipart body
it cannot parse (no boundary) with a bare 400 of its own, not the API's
envelope. Turned off, the application gets every body and answers it
(a 415 envelope under /api/)."""

from channels.auth import AuthMiddlewareStack
from daphne.http_protocol import WebRequest
from django.urls import path

from runs.api.live import RunStreamConsumer, RunWaitConsumer

# Twisted's Request.__init__ assigns the flag; a data descriptor keeps it off.
WebRequest._parsePOSTFormSubmission = property(lambda request: False, lambda request, value: None)

waiting_urlpatterns = [
    path("api/v1/runs/<int:run_id>/wait", AuthMiddlewareStack(RunWaitConsumer.as_asgi())),
    path("api/v1/runs/<int:run_id>/stream", AuthMiddlewareStack(RunStreamConsumer.as_asgi())),
]
