"""Celery tasks: ids in, re-fetch, call one service. Each is safe to deliver
twice: the services re-read the rows and claim work by compare-and-swap.
The kernel sends them by name (``runs.dispatch``) and never imports this
module, which sits on top of it."""

from celery import shared_task
from celery.signals import celeryd_after_setup, worker_ready
from django.conf import settings

from runs.dataplane import SANDBOX_QUEUE, can_sandbox, current_host, host_queue
from runs.execution import execute_claims, run_settle, step_execute, step_reattach
from runs.pipeline import run_advance
from runs.recovery import host_recover
from runs.retention import purge_expired_artifacts
from runs.sweeper import sweep_zombies
from runs.webhooks import WebhookFailed, webhook_deliver


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
    sweep_zombies()


@shared_task(acks_late=True, ignore_result=True)
def reattach_step(step_pk: int, attempt: int) -> None:
    execute_claims(step_reattach(step_pk, attempt))


@shared_task(ignore_result=True)
def purge_expired_run_artifacts() -> None:
    purge_expired_artifacts()


# Retries are declared, but the countdown is the service's (EXECGO_WEBHOOK_BACKOFF_S
# doubling per attempt, from the row's own count): Celery's retry_backoff
# rounds its factor to a whole second of at least 1. The row also decides
# when to give up (EXECGO_WEBHOOK_MAX_ATTEMPTS); max_retries is the backstop.
@shared_task(bind=True, acks_late=True, ignore_result=True, max_retries=settings.EXECGO_WEBHOOK_MAX_ATTEMPTS - 1)
def deliver_webhook(self, delivery_id: int) -> None:
    try:
        webhook_deliver(delivery_id)
    except WebhookFailed as failed:
        raise self.retry(exc=failed, countdown=failed.retry_in) from None


@celeryd_after_setup.connect
def _consume_host_queues(sender, instance, **kwargs):
    """Every worker also consumes its host's queue (re-attachment), and the
    sandbox queue when this host can run the linux_sandbox profile."""
    instance.app.amqp.queues.select_add(host_queue(current_host()))
    if can_sandbox():
        instance.app.amqp.queues.select_add(SANDBOX_QUEUE)


@worker_ready.connect
def _recover_host(sender, **kwargs):
    host_recover()
