"""Hand work to the Celery workers, after commit, by task name.

A claim names one step attempt and the queue of the workers that may run
it (routing by capability). Tasks are sent by name, so the kernel never
imports its own task module (``runs.tasks`` sits on top and calls down).
Everything here is sent only once the caller's transaction has committed:
a worker must find the rows it is told about.

Nothing sent is lost to a broker outage. Work accepted from outside (a
submitted run, a cancel, a decision: ``durable``) writes a ``Dispatch`` row
in the caller's transaction, deleted once the broker took the message; any
other message the broker refuses after commit is written as such a row
then. ``relay_dispatches`` sends the rows left (beat, and each worker's
start). A message the broker took and then lost (a Redis restarted empty,
a worker killed holding one) is the sweeper's to send again
(``runs.sweeper``). Every task is safe to deliver twice.
"""

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from celery import current_app
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from kombu.exceptions import ChannelError, OperationalError

from runs.dataplane import DEFAULT_QUEUE, capability_queues, host_capabilities, host_queue
from runs.models import Dispatch, Run, Step
from runtime.forkserver import ShimLink

logger = logging.getLogger(__name__)
# What a broker that cannot take a message raises (Redis down: kombu's
# OperationalError; the filesystem broker: ChannelError or an OSError).
BROKER_ERRORS = (OperationalError, ChannelError, OSError)
# A row younger than this may still be on its way in its own commit's
# callback: the relay leaves it to that callback.
RELAY_AFTER = timedelta(seconds=1)

ADVANCE_RUN = "runs.tasks.advance_run"
EXECUTE_STEP = "runs.tasks.execute_step"
SETTLE_RUN = "runs.tasks.settle_run"
REATTACH_STEP = "runs.tasks.reattach_step"
WATCHED_END = "runs.tasks.record_watched_step"
HEAL_HOST = "runs.tasks.heal_host"
PURGE_HOST = "runs.tasks.purge_host_artifacts"
SWEEP_RUN = "runs.tasks.sweep_stuck_run"
EXPIRE_APPROVAL = "approvals.tasks.expire_approval_request"
SEND_NOTIFICATION = "approvals.tasks.send_notification"


@dataclass(frozen=True)
class Claim:
    """A dispatched step attempt, and the queue of the workers that may run it."""

    step_pk: int
    attempt: int
    queue: str = DEFAULT_QUEUE
    # Set when settle already started the attempt for this worker (the
    # common case of a sequential plan), its slot already held: the step as
    # written, and whether that slot is the finished step's, handed over
    # (else the finished step's is still to be given back).
    started: Step | None = field(default=None, compare=False)
    reserved: bool = False
    # The run's steps as that settle saw them, when the started attempt is
    # the only one in flight: until it finishes nobody else dispatches, so
    # its finish settles from these instead of reading every step again.
    steps: list[Step] | None = field(default=None, compare=False)
    # A shim forked ahead for the started attempt (``dataplane.warm_shim``).
    spare: ShimLink | None = field(default=None, compare=False)
    # The run whose timer is owed once this worker's chain of claims ends
    # (``settle.arm_timer_if_executing``): set by the claim of a run that has
    # just entered EXECUTING, whose timer is not armed before it is needed.
    timer_owed: Run | None = field(default=None, compare=False)

    def runnable_here(self) -> bool:
        return self.queue == DEFAULT_QUEUE or self.queue in capability_queues(host_capabilities())


def _send(task: str, args: tuple, *, queue: str | None = None, countdown: float | None = None,
          eta: datetime | None = None, expires: float | None = None, durable: bool = False) -> None:
    """Send ``task`` once the caller's transaction commits. ``durable``: its
    ``Dispatch`` row commits with that transaction (see the module's docstring)."""
    now = timezone.now()
    if countdown:  # absolute, so a relayed message keeps its moment
        eta = now + timedelta(seconds=countdown)
    expires_at = now + timedelta(seconds=expires) if expires is not None else None
    row = Dispatch.objects.create(task=task, args=list(args), queue=queue or "", eta=eta,
                                  expires_at=expires_at) if durable else None
    transaction.on_commit(lambda: _publish(task, args, queue=queue, eta=eta, expires_at=expires_at, row=row))


def _apply(task: str, args, *, queue: str | None, eta: datetime | None, expires_at: datetime | None) -> None:
    # A signature resolves to the registered task where this process has it
    # (so CELERY_TASK_ALWAYS_EAGER runs it inline) and is sent by name otherwise.
    # No retries here: a broker that refuses now is the relay's to retry.
    current_app.signature(task, args=tuple(args)).apply_async(queue=queue or None, eta=eta, expires=expires_at,
                                                              retry=False)


def _publish(task: str, args, *, queue: str | None, eta: datetime | None, expires_at: datetime | None,
             row: Dispatch | None) -> None:
    try:
        _apply(task, args, queue=queue, eta=eta, expires_at=expires_at)
    except BROKER_ERRORS as exc:
        error = f"{exc.__class__.__name__}: {exc}"[:200]
        logger.warning("the broker did not take %s%s (%s); the dispatch relay sends it", task, tuple(args), error)
        if row is None:
            Dispatch.objects.create(task=task, args=list(args), queue=queue or "", eta=eta, expires_at=expires_at,
                                    attempts=1, last_error=error)
        else:
            Dispatch.objects.filter(pk=row.pk).update(attempts=F("attempts") + 1, last_error=error)
        return
    if row is not None:
        Dispatch.objects.filter(pk=row.pk).delete()


def relay_dispatches(*, limit: int = 500) -> int:
    """Send the messages the broker has not taken yet, oldest first; stop at
    the first it refuses (it is still down). Returns how many were sent. A
    message past its expiry is dropped, as the broker would have."""
    now, sent = timezone.now(), 0
    waiting = Dispatch.objects.filter(created_at__lt=now - RELAY_AFTER)
    if not waiting.exists():  # the rule: no write transaction (on SQLite, a lock) for nothing
        return 0
    with transaction.atomic():
        # skip_locked: relays running at once (beat's, a starting worker's) share the rows.
        rows = list(waiting.select_for_update(skip_locked=True).order_by("pk")[:limit])
        done = []
        for row in rows:
            if row.expires_at is None or row.expires_at > now:
                try:
                    _apply(row.task, row.args, queue=row.queue, eta=row.eta, expires_at=row.expires_at)
                except BROKER_ERRORS as exc:
                    Dispatch.objects.filter(pk=row.pk).update(attempts=F("attempts") + 1,
                                                              last_error=f"{exc.__class__.__name__}: {exc}"[:200])
                    break
                sent += 1
            done.append(row.pk)
        Dispatch.objects.filter(pk__in=done).delete()
    if sent:
        logger.info("relayed %d message(s) the broker had not taken", sent)
    return sent


def enqueue_advance(run_id: int, *, durable: bool = False) -> None:
    _send(ADVANCE_RUN, (run_id,), durable=durable)


def enqueue_claims(claims: list[Claim], *, countdown: float = 0) -> None:
    for claim in claims:
        _send(EXECUTE_STEP, (claim.step_pk, claim.attempt), queue=claim.queue, countdown=countdown or None)


def enqueue_settle(run_id: int, *, countdown: float | None = None, expires: float | None = None,
                   durable: bool = False) -> None:
    _send(SETTLE_RUN, (run_id,), countdown=countdown, expires=expires, durable=durable)


def enqueue_approval_expiry(request_id: int, *, eta) -> None:
    """The expiry of an approval request, at the minute it is due."""
    _send(EXPIRE_APPROVAL, (request_id,), eta=eta)


def enqueue_notification(notification_id: int, *, countdown: float | None = None) -> None:
    """Send one approvers' notification (its row is its own outbox: the
    notification relay sends a row whose message was lost)."""
    _send(SEND_NOTIFICATION, (notification_id,), countdown=countdown)


def enqueue_reattach(step: Step, host: str) -> None:
    _send(REATTACH_STEP, (step.pk, step.attempt), queue=host_queue(host))


def enqueue_watched_end(step_pk: int, attempt: int, host: str) -> None:
    """Record the result of a step attempt whose shim the watcher of a
    worker on ``host`` saw end (its result.json is on that host)."""
    _send(WATCHED_END, (step_pk, attempt), queue=host_queue(host))


def enqueue_sweeps(run_ids: list[int]) -> None:
    """One close of a stuck run per task, for any worker to take."""
    for run_id in run_ids:
        _send(SWEEP_RUN, (run_id,))


def enqueue_heal(host: str, *, expires: float | None = None) -> None:
    """A ledger heal on ``host`` (its pids mean something only there). With
    ``expires``, a heal no worker of that host took in time is dropped: the
    next one is on its way, and a gone host's queue does not fill up."""
    _send(HEAL_HOST, (), queue=host_queue(host), expires=expires)


def enqueue_purge(host: str, *, expires: float | None = None) -> None:
    """The retention GC's purge of ``host``'s own task directories (they are
    on its disk only); ``expires`` as for ``enqueue_heal``."""
    _send(PURGE_HOST, (), queue=host_queue(host), expires=expires)
