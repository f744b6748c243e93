"""The API's waiting endpoints, routed before Django's middleware (see
runs/api/live.py); the session reaches them through AuthMiddlewareStack."""

from channels.auth import AuthMiddlewareStack
from django.urls import path

from runs.api.live import RunStreamConsumer, RunWaitConsumer

waiting_urlpatterns = [
    path("api/v1/runs/<int:run_id>/wait", AuthMiddlewareStack(RunWaitConsumer.as_asgi())),
    path("api/v1/runs/<int:run_id>/stream", AuthMiddlewareStack(RunStreamConsumer.as_asgi())),
]
