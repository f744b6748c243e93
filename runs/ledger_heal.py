"""Healing the resource ledger while the worker runs.

A Celery pool process killed in the middle of a step (``kill -9``, the OOM
killer) never releases its reservation, and its worker goes on with a new
pool process: nothing restarts, so ``recovery.host_recover`` never runs.
``ledger_heal`` gives back this host's reservations whose owner process is
gone, audits each, and re-attaches the steps that were running under them
(their shim may still run, or have left its result), or re-delivers an
attempt it had reserved for but not claimed, or finishes closing a run it
died closing (TRACING, or a transient state). It runs when a pool
process starts (a dead one is replaced at once), from beat every
EXECGO_LEDGER_HEAL_INTERVAL_S, and whenever a step finds its host full.

The audit rows are written here, not in ``runtime``: Tier 3 knows nothing
of runs; ``runtime.ledger.reclaim`` returns what it reclaimed instead.
"""

import logging

from runs.audit import audit
from runs.closing import run_close
from runs.dataplane import current_host, queue_for, reclaim_reservations
from runs.dispatch import Claim, enqueue_claims, enqueue_reattach
from runs.models import AuditEvent, Step, StepRunStatus
from runs.statemachine import TRANSIENT, RunState
from runs.step_lifecycle import IN_FLIGHT
from runs.transitions import InvalidTransitionError, TransitionLost

logger = logging.getLogger(__name__)


def _in_flight(handles) -> set[str]:
    return set(Step.objects.filter(handle_id__in=list(handles), run_status__in=IN_FLIGHT)
               .values_list("handle_id", flat=True))


def ledger_heal() -> list[dict]:
    """Reclaim this host's reservations of dead owners; return what was reclaimed."""
    host = current_host()
    reclaimed = reclaim_reservations(_in_flight)
    if not reclaimed:
        return []
    steps = {step.handle_id: step for step in Step.objects.select_related("run").filter(
        handle_id__in=[row["handle_id"] for row in reclaimed]).only(
        "pk", "step_id", "attempt", "handle_id", "host", "run_status", "requested_plan", "run__id",
        "run__tenant_id", "run__state")}
    closing = []
    for row in reclaimed:
        step = steps.get(row["handle_id"])
        # Only the heal whose DELETE removed the row sees it, so one
        # re-attachment (or re-delivery) is sent per orphaned attempt.
        then = ""
        if step is not None and step.run_status == StepRunStatus.RUNNING and step.host == host:
            enqueue_reattach(step, host)
            then = "reattached"
        elif step is not None and step.run_status == StepRunStatus.ACCEPTED:
            # The process died between reserving and claiming: its message
            # was acknowledged with it. A duplicate is harmless (the claim).
            enqueue_claims([Claim(step.pk, step.attempt, queue_for(step))])
            then = "redelivered"
        elif step is not None and (step.run.state == RunState.TRACING or step.run.state in TRANSIENT):
            # It died closing the run (a finished step's slot is given back
            # after the close): the close is finished here, not by the sweeper.
            closing.append(step.run_id)
            then = "closed"
        audit(AuditEvent.RESERVATION_RECLAIMED, run_id=step.run_id if step else None,
              tenant_id=step.run.tenant_id if step else None, caller="ledger heal",
              data={**row, "step": step.step_id if step else "", "attempt": step.attempt if step else None,
                    "then": then})
    for run_id in closing:
        try:
            run_close(run_id)
        except (TransitionLost, InvalidTransitionError) as exc:  # another writer closed it meanwhile
            logger.info("ledger heal left run %s: %s", run_id, exc)
    logger.warning("ledger heal on %s reclaimed %s", host, [row["handle_id"] for row in reclaimed])
    return reclaimed
