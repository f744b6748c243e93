"""Worker start on a host: announce capabilities, rebuild the ledger, and
pick up what a dead worker left behind
(docs/data-plane.md#recovery-after-a-worker-restart).

- a step marked running on this host is re-attached: its shim is waited
  for (or its result read); a shim that is gone without a result fails the
  step with an ``internal`` error;
- an accepted attempt whose message may have died with the worker is
  delivered again (the claim makes a duplicate harmless).

A pool process that dies while its worker lives is healed without a
restart (``runs.ledger_heal``); ``hosts_to_heal`` names the hosts beat asks.
"""

import logging
from datetime import timedelta

from django.utils import timezone

from runs.dataplane import current_host, queue_for
from runs.dispatch import Claim, enqueue_claims, enqueue_reattach
from runs.models import Step, StepRunStatus
from runs.statemachine import RunState
from runtime import attach, ledger
from runtime.capabilities import capability_manifest
from runtime.models import HostCapacity

logger = logging.getLogger(__name__)


def host_recover(host: str | None = None) -> dict:
    host = host or current_host()
    manifest = capability_manifest(refresh=True)
    ledger.host_register(host, capabilities=manifest)
    running = list(Step.objects.filter(host=host, run_status=StepRunStatus.RUNNING).only("pk", "attempt",
                                                                                          "handle_id"))
    running_handles = {step.handle_id for step in running}
    ledger.recover(host, keep=lambda handle: handle in running_handles and attach.shim_alive(handle))
    for step in running:
        enqueue_reattach(step, host)
    queued = list(Step.objects.filter(run_status=StepRunStatus.ACCEPTED, run__state=RunState.EXECUTING))
    enqueue_claims([Claim(step.pk, step.attempt, queue_for(step)) for step in queued])
    summary = {"host": host, "reattached": [s.pk for s in running], "redelivered": [s.pk for s in queued]}
    logger.info("recovery on %s: %s", host, summary)
    return summary


# A host not seen for this long (no worker start, no heal) gets no heal
# messages: a Redis queue nobody consumes would only fill up with them.
HOST_GONE_AFTER = timedelta(hours=1)


def hosts_to_heal() -> list[str]:
    """The hosts seen lately (each heal refreshes its host's ``last_seen``)."""
    return list(HostCapacity.objects.filter(last_seen__gte=timezone.now() - HOST_GONE_AFTER)
                .values_list("host", flat=True))
