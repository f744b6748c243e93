"""Retention GC (docs/data-plane.md#retention): workspaces and logs of final
runs are purged after the retention period; Run, Step, Trace and AuditLog
rows stay, and the purge itself is audited.

A task directory is on the disk of the host that ran its attempt, so each
host purges its own (beat sends every host seen lately its purge, on its
host queue, as it does the ledger heal): it lists its task directories that
still hold a workspace or a log and purges those whose step's run is final
and ended more than ``EXECGO_TASK_RETENTION_S`` ago. Each host's purge of a
run is audited, naming the host; the run is stamped at the first."""

from collections import defaultdict
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from runs.audit import audit
from runs.dataplane import current_host, handle_step_pk
from runs.models import AuditEvent, Run, Step
from runs.statemachine import FINAL
from runtime.gc import handles_with_artifacts, purge_task_dirs

# Steps looked up at once (a parameter each).
LOOKUP_BATCH = 1000


def purge_expired_artifacts(*, now=None) -> list[int]:
    """This host's part of the retention GC (see the module docstring) ->
    the runs some of whose task directories it purged. A directory whose
    shim still runs is left for the next purge."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.EXECGO_TASK_RETENTION_S)
    waiting: dict[int, list[str]] = defaultdict(list)
    for handle_id in handles_with_artifacts():
        if (step_pk := handle_step_pk(handle_id)) is not None:
            waiting[step_pk].append(handle_id)
    step_pks = sorted(waiting)
    handles_of: dict[int, list[str]] = defaultdict(list)
    tenant_of: dict[int, int] = {}
    for start in range(0, len(step_pks), LOOKUP_BATCH):
        expired = Step.objects.filter(pk__in=step_pks[start:start + LOOKUP_BATCH], run__state__in=FINAL,
                                      run__finished_at__lt=cutoff).values_list("pk", "run_id", "run__tenant_id")
        for step_pk, run_id, tenant_id in expired:
            handles_of[run_id] += waiting[step_pk]
            tenant_of[run_id] = tenant_id
    purged = []
    for run_id in sorted(handles_of):
        removed = purge_task_dirs(sorted(handles_of[run_id]))
        if not removed:
            continue
        with transaction.atomic():
            Run.objects.filter(pk=run_id, artifacts_purged_at__isnull=True).update(artifacts_purged_at=now)
            audit(AuditEvent.ARTIFACTS_PURGED, run_id=run_id, tenant_id=tenant_of[run_id], caller="gc",
                  data={"host": current_host(), "removed": removed,
                        "retention_s": settings.EXECGO_TASK_RETENTION_S})
        purged.append(run_id)
    return purged
