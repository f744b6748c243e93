"""Celery tasks: ids in, re-fetch, call one service. Each is safe to deliver
twice: the services re-read the rows and claim work by compare-and-swap."""

from celery import shared_task
from celery.signals import celeryd_after_setup, worker_ready

from runs.execution import execute_claims, run_settle, step_execute
from runs.pipeline import run_advance


@shared_task(acks_late=True, ignore_result=True)
def advance_run(run_id: int) -> None:
    execute_claims(run_advance(run_id))


@shared_task(acks_late=True, ignore_result=True)
def execute_step(step_pk: int, attempt: int) -> None:
    execute_claims(step_execute(step_pk, attempt))


@shared_task(acks_late=True, ignore_result=True)
def settle_run(run_id: int) -> None:
    execute_claims(run_settle(run_id, claim_one=True))


@shared_task(ignore_result=True)
def sweep_zombie_runs() -> None:
    from runs.sweeper import sweep_zombies

    sweep_zombies()


@shared_task(acks_late=True, ignore_result=True)
def reattach_step(step_pk: int, attempt: int) -> None:
    from runs.execution import step_reattach

    execute_claims(step_reattach(step_pk, attempt))


@celeryd_after_setup.connect
def _consume_host_queues(sender, instance, **kwargs):
    """Every worker also consumes its host's queue (re-attachment), and the
    sandbox queue when this host can run the linux_sandbox profile."""
    from runs.step_runner import SANDBOX_QUEUE, can_sandbox, current_host, host_queue

    instance.app.amqp.queues.select_add(host_queue(current_host()))
    if can_sandbox():
        instance.app.amqp.queues.select_add(SANDBOX_QUEUE)


@worker_ready.connect
def _recover_host(sender, **kwargs):
    from runs.recovery import host_recover

    host_recover()


@shared_task(ignore_result=True)
def purge_expired_run_artifacts() -> None:
    from runs.retention import purge_expired_artifacts

    purge_expired_artifacts()
