"""Hand work to the Celery workers, after commit, by task name.

A claim names one step attempt and the queue of the workers that may run
it (routing by capability). Tasks are sent by name, so the kernel never
imports its own task module (``runs.tasks`` sits on top and calls down).
Everything here is sent only once the caller's transaction has committed:
a worker must find the rows it is told about.
"""

from dataclasses import dataclass, field

from celery import current_app
from django.db import transaction

from runs.dataplane import DEFAULT_QUEUE, SANDBOX_QUEUE, can_sandbox, host_queue
from runs.models import Step
from runtime.forkserver import ShimLink

ADVANCE_RUN = "runs.tasks.advance_run"
EXECUTE_STEP = "runs.tasks.execute_step"
SETTLE_RUN = "runs.tasks.settle_run"
REATTACH_STEP = "runs.tasks.reattach_step"
HEAL_HOST = "runs.tasks.heal_host"
SWEEP_RUN = "runs.tasks.sweep_stuck_run"
EXPIRE_APPROVAL = "approvals.tasks.expire_approval_request"


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

    def runnable_here(self) -> bool:
        return self.queue == DEFAULT_QUEUE or (self.queue == SANDBOX_QUEUE and can_sandbox())


def _send(task: str, args: tuple, *, queue: str | None = None, countdown: float | None = None, eta=None,
          expires: float | None = None) -> None:
    # A signature resolves to the registered task where this process has it
    # (so CELERY_TASK_ALWAYS_EAGER runs it inline) and is sent by name otherwise.
    transaction.on_commit(lambda: current_app.signature(task, args=args).apply_async(queue=queue, countdown=countdown,
                                                                                      eta=eta, expires=expires))


def enqueue_advance(run_id: int) -> None:
    _send(ADVANCE_RUN, (run_id,))


def enqueue_claims(claims: list[Claim], *, countdown: float = 0) -> None:
    for claim in claims:
        _send(EXECUTE_STEP, (claim.step_pk, claim.attempt), queue=claim.queue, countdown=countdown or None)


def enqueue_settle(run_id: int, *, countdown: float | None = None, expires: float | None = None) -> None:
    _send(SETTLE_RUN, (run_id,), countdown=countdown, expires=expires)


def enqueue_approval_expiry(request_id: int, *, eta) -> None:
    """The expiry of an approval request, at the minute it is due."""
    _send(EXPIRE_APPROVAL, (request_id,), eta=eta)


def enqueue_reattach(step: Step, host: str) -> None:
    _send(REATTACH_STEP, (step.pk, step.attempt), queue=host_queue(host))


def enqueue_sweeps(run_ids: list[int]) -> None:
    """One close of a stuck run per task, for any worker to take."""
    for run_id in run_ids:
        _send(SWEEP_RUN, (run_id,))


def enqueue_heal(host: str, *, expires: float | None = None) -> None:
    """A ledger heal on ``host`` (its pids mean something only there). With
    ``expires``, a heal no worker of that host took in time is dropped: the
    next one is on its way, and a gone host's queue does not fill up."""
    _send(HEAL_HOST, (), queue=host_queue(host), expires=expires)
