"""Liveness and readiness probes."""

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import connection
from django.http import JsonResponse

from execgo.celery import app as celery_app


def healthz(request):
    return JsonResponse({"status": "ok"})


def _database() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return "ok"


def _broker() -> str:
    with celery_app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, timeout=2)
    return "ok"


def _channel_layer() -> str:
    layer = get_channel_layer()
    if layer is None:
        raise RuntimeError("no channel layer configured")
    async_to_sync(layer.send)("readyz.probe", {"type": "readyz.probe"})
    return "ok"


def readyz(request):
    checks, ready = {}, True
    for name, probe in (("database", _database), ("broker", _broker), ("channel_layer", _channel_layer)):
        try:
            checks[name] = probe()
        except Exception as exc:  # a probe reports any failure as "not ready", never a 500
            checks[name] = f"error: {exc.__class__.__name__}"
            ready = False
    return JsonResponse({"status": "ok" if ready else "unavailable", "checks": checks}, status=200 if ready else 503)
