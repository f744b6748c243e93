"""Liveness and readiness probes."""

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import connection
from django.http import JsonResponse

from execgo.celery import app as celery_app
from runtime.models import HostCapacity


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


def _hosts() -> list[dict]:
    """What each worker host announced at start: capacity, use, capabilities."""
    return [
        {"host": row.host, "last_seen": row.last_seen, "task_slots": row.task_slots_capacity,
         "task_slots_reserved": row.task_slots_reserved, "capabilities": row.capabilities}
        for row in HostCapacity.objects.order_by("host")
    ]


def readyz(request):
    checks, ready = {}, True
    for name, probe in (("database", _database), ("broker", _broker), ("channel_layer", _channel_layer)):
        try:
            checks[name] = probe()
        except Exception as exc:  # a probe reports any failure as "not ready", never a 500
            checks[name] = f"error: {exc.__class__.__name__}"
            ready = False
    body = {"status": "ok" if ready else "unavailable", "checks": checks}
    if checks["database"] == "ok":
        body["hosts"] = _hosts()
    return JsonResponse(body, status=200 if ready else 503)
