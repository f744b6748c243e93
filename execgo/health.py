"""Liveness (/healthz: the process answers) and readiness (/readyz: what a
run needs is there).

Readiness checks, each reported by name, any failure answering 503:
database, broker, channel layer, at least one live worker (a Celery ping
over the broker, which the filesystem broker of the embedded default
carries too) and beat (the sweeper's entry ran within two of its
intervals: beat writes its ``last_run_at`` at every dispatch).

Anyone may ask whether the service is ready (a load balancer, an
orchestrator's probe) and gets only that: ``{"status": "ready"}`` or
``{"status": "not ready"}``. The checks by name, their errors and what
each worker host announced (kernel, uid, sandbox tools and their versions)
are for operators: the metrics token or a staff user (runs/operators.py).
"""

import asyncio
import uuid
from datetime import timedelta

from channels.layers import get_channel_layer
from django.conf import settings
from django.db import connection
from django.http import JsonResponse
from django.utils import timezone
from django_celery_beat.models import PeriodicTask

from execgo.celery import app as celery_app
from runs.operators import readiness_details_allowed
from runs.sessions import run_to_its_end
from runtime.models import HostCapacity

SWEEP_TASK = "runs.tasks.sweep_zombie_runs"


class NotReady(Exception):
    """A check that failed, with what an operator should read."""


def healthz(request):
    return JsonResponse({"status": "ok"})


def _database() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return "ok"


def _broker() -> str:
    with celery_app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, timeout=settings.EXECGO_READYZ_TIMEOUT_S)
    return "ok"


def _channel_layer() -> str:
    layer = get_channel_layer()
    if layer is None:
        raise NotReady("no channel layer configured")
    run_to_its_end(_round_trip, layer)
    return "ok"


async def _round_trip(layer) -> None:
    """A message sent to a channel of the probe's own and received back, so
    that a probe leaves nothing behind: a layer keeps at most ``capacity``
    (100) unreceived messages a channel, for a minute, and a probe that only
    sent to one channel was refused from its 101st ask within a minute on,
    so that asking more often than every 0.6 s made a ready service not
    ready."""
    channel = f"readyz.probe.{uuid.uuid4().hex}"
    await layer.send(channel, {"type": "readyz.probe"})
    await asyncio.wait_for(layer.receive(channel), settings.EXECGO_READYZ_TIMEOUT_S)


def _workers() -> str:
    timeout = settings.EXECGO_READYZ_TIMEOUT_S
    with celery_app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, timeout=timeout)
        # limit=1: the first answer is enough, no need to wait out the timeout.
        replies = celery_app.control.ping(timeout=timeout, limit=1, connection=conn)
    if not replies:
        raise NotReady(f"no worker answered a ping within {timeout:g}s")
    return "ok"


def _beat() -> str:
    entry = PeriodicTask.objects.filter(task=SWEEP_TASK, enabled=True).select_related("interval").first()
    if entry is None:
        raise NotReady("the sweeper has no enabled beat entry: beat never started")
    if entry.last_run_at is None:
        raise NotReady("beat never ran the sweeper")
    interval = (timedelta(seconds=entry.interval.every * _PERIOD_S[entry.interval.period])
                if entry.interval is not None else
                timedelta(seconds=settings.CELERY_BEAT_SCHEDULE["sweep-zombie-runs"]["schedule"]))
    age = timezone.now() - entry.last_run_at
    if age > 2 * interval:
        raise NotReady(f"beat last ran the sweeper {int(age.total_seconds())}s ago "
                       f"(every {int(interval.total_seconds())}s)")
    return "ok"


_PERIOD_S = {"microseconds": 1e-6, "seconds": 1, "minutes": 60, "hours": 3600, "days": 86400}


def _hosts() -> list[dict]:
    """What each worker host announced at start: capacity, use, capabilities."""
    return [
        {"host": row.host, "last_seen": row.last_seen, "task_slots": row.task_slots_capacity,
         "task_slots_reserved": row.task_slots_reserved, "capabilities": row.capabilities}
        for row in HostCapacity.objects.order_by("host")
    ]


CHECKS = (("database", _database), ("broker", _broker), ("channel_layer", _channel_layer),
          ("workers", _workers), ("beat", _beat))


def readyz(request):
    checks, ready = {}, True
    for name, probe in CHECKS:
        try:
            checks[name] = probe()
        except NotReady as exc:
            checks[name], ready = f"error: {exc}", False
        except Exception as exc:  # a probe reports any failure as "not ready", never a 500
            # The class only: a message could carry a connection string.
            checks[name], ready = f"error: {exc.__class__.__name__}", False
    status = 200 if ready else 503
    if not readiness_details_allowed(request):
        return JsonResponse({"status": "ready" if ready else "not ready"}, status=status)
    body = {"status": "ok" if ready else "unavailable", "checks": checks}
    if checks["database"] == "ok":
        body["hosts"] = _hosts()
    return JsonResponse(body, status=status)
