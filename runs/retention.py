"""Retention GC (docs/data-plane.md#retention): workspaces and logs of final
runs are purged after the retention period; Run, Step, Trace and AuditLog
rows stay, and the purge itself is audited."""

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from runs.audit import audit
from runs.models import AuditEvent, Event, Run, Step
from runs.statemachine import FINAL
from runtime.gc import purge_task_dirs


def run_handles(run: Run) -> set[str]:
    """Every attempt's handle: the step rows keep only the latest one, the
    events name them all."""
    handles = set(Event.objects.filter(run=run).exclude(handle_id="").values_list("handle_id", flat=True))
    handles |= set(Step.objects.filter(run=run).exclude(handle_id="").values_list("handle_id", flat=True))
    return handles


def purge_expired_artifacts(*, now=None, batch: int = 200) -> list[int]:
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.EXECGO_TASK_RETENTION_S)
    purged = []
    expired = Run.objects.filter(state__in=FINAL, finished_at__lt=cutoff, artifacts_purged_at__isnull=True)
    for run in expired.order_by("pk")[:batch]:
        removed = purge_task_dirs(sorted(run_handles(run)))
        with transaction.atomic():
            if Run.objects.filter(pk=run.pk, artifacts_purged_at__isnull=True).update(artifacts_purged_at=now):
                audit(AuditEvent.ARTIFACTS_PURGED, run_id=run.pk, tenant_id=run.tenant_id, caller="gc",
                      data={"removed": removed, "retention_s": settings.EXECGO_TASK_RETENTION_S})
                purged.append(run.pk)
    return purged
