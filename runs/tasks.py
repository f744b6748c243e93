"""Celery tasks: ids in, re-fetch, call one service. Each is safe to deliver
twice: the services re-read the rows and claim work by compare-and-swap.
The kernel sends them by name (``runs.dispatch``) and never imports this
module, which sits on top of it.

The harness's tasks go back to their queue when the pool process running
them dies (``reject_on_worker_lost``): with ``acks_late`` alone Celery
acknowledges such a message, and it also loses the one the dead process had
been handed but not started. A re-delivery is harmless for the same reason
a duplicate is, and cannot loop on a step that kills its process: a step
runs in its shim, outside the pool process."""

import logging
import os

from celery import shared_task
from celery.signals import celeryd_after_setup, task_prerun, worker_process_init, worker_ready, worker_shutdown
from django.conf import settings
from django.db import close_old_connections

from runs import step_watch
from runs.dataplane import capability_queues, current_host, host_capabilities, host_queue
from runs.deadlines import scan_deadlines
from runs.dispatch import enqueue_heal, enqueue_purge, relay_dispatches
from runs.execution import execute_claims, step_execute, step_reattach, step_watched_end
from runs.ledger_heal import ledger_heal
from runs.pipeline import run_advance
from runs.retention import purge_expired_artifacts
from runs.settle import RUN_TIMER, run_settle
from runs.sweeper import sweep_one, sweep_zombies
from runs.webhooks import WebhookFailed, webhook_deliver
from runs.worker_start import host_recover, hosts_to_heal
from runtime import forkserver
from runtime.layout import tasks_dir


@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def advance_run(run_id: int) -> None:
    execute_claims(run_advance(run_id))


@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def execute_step(step_pk: int, attempt: int) -> None:
    execute_claims(step_execute(step_pk, attempt))


@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def settle_run(run_id: int) -> None:
    """The run's timer (``settle.executing_started``), and the settle a
    cancel sends: a timeout it decides is the timer's (a cancel wins over it)."""
    execute_claims(run_settle(run_id, claim_one=True, caller=RUN_TIMER))


@shared_task(ignore_result=True)
def sweep_zombie_runs() -> None:
    sweep_zombies(inline_max=settings.EXECGO_SWEEP_INLINE_MAX)


@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def sweep_stuck_run(run_id: int) -> None:
    sweep_one(run_id)


@shared_task(ignore_result=True)
def relay_dispatched_messages() -> None:
    relay_dispatches()


@shared_task(ignore_result=True)
def scan_run_deadlines() -> None:
    scan_deadlines()


@shared_task(ignore_result=True)
def heal_ledgers() -> None:
    """Beat: a ledger heal on every host (each on its own host queue)."""
    for host in hosts_to_heal():
        enqueue_heal(host, expires=max(settings.EXECGO_LEDGER_HEAL_INTERVAL_S * 2, 5.0))


@shared_task(ignore_result=True)
def heal_host() -> None:
    ledger_heal()


@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def reattach_step(step_pk: int, attempt: int) -> None:
    execute_claims(step_reattach(step_pk, attempt))


@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def record_watched_step(step_pk: int, attempt: int) -> None:
    execute_claims(step_watched_end(step_pk, attempt))


@shared_task(ignore_result=True)
def purge_expired_run_artifacts() -> None:
    """Beat: the retention GC on every host (each on its own host queue:
    a task directory is on its host's disk only)."""
    for host in hosts_to_heal():
        enqueue_purge(host, expires=settings.EXECGO_GC_INTERVAL_S)


@shared_task(ignore_result=True)
def purge_host_artifacts() -> None:
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
    """Every worker also consumes its host's queue (re-attachment, the ledger
    heal, the retention purge: what only a worker of that host can do), and the
    capability queue of every set of capabilities this host has (a step goes
    to the queue of what its rated plan needs, ``dataplane.queue_for``)."""
    instance.app.amqp.queues.select_add(host_queue(current_host()))
    for queue in capability_queues(host_capabilities()):
        instance.app.amqp.queues.select_add(queue)


@worker_ready.connect
def _recover_host(sender, **kwargs):
    # The watcher first: the steps recovery re-attaches are handed to it.
    step_watch.start()
    host_recover()
    try:
        relay_dispatches()
    except Exception:  # beat's relay follows within seconds
        logging.getLogger(__name__).exception("could not relay the dispatch outbox at start")


@worker_shutdown.connect
def _stop_the_shim_server(**kwargs):
    """A worker that stops takes this host's shim fork server with it (the
    next worker to start a step starts another). Shims already forked are
    detached from it and finish all the same."""
    step_watch.stop()
    forkserver.stop_server(str(tasks_dir()))


@task_prerun.connect
def _usable_connections(sender=None, **kwargs):
    """A connection kept from the task before (``CELERY_DB_REUSE_MAX``) is
    closed if it is past its age or broken (a database restarted, a
    connection terminated): the task opens a new one. Not for a task run
    eagerly, inside its caller's transaction."""
    if not getattr(getattr(sender, "request", None), "is_eager", False):
        close_old_connections()


@worker_process_init.connect
def _own_process_group(**kwargs):
    """A pool process leaves its worker's process group, so a signal to the
    group (a process manager's SIGTERM, a terminal's Ctrl-C) reaches the
    worker alone, which then shuts its pool down itself after the tasks in
    hand (a warm shutdown). Otherwise the pool processes die at once and
    the worker, mid-shutdown, starts new ones in their place. A pool process
    still dies with its worker (Celery gives it a parent-death signal)."""
    os.setpgid(0, 0)


@worker_process_init.connect
def _heal_when_a_pool_process_starts(**kwargs):
    """A pool process starts with its worker, and in place of one that died
    (``kill -9``, the OOM killer): what the dead one held is healed now,
    not at the next beat. Only sent from here: the heal itself runs as a
    task, outside the pool process's start (which Celery times)."""
    try:
        enqueue_heal(current_host(), expires=60.0)
    except Exception:  # the broker unreachable at this instant: beat's heal follows
        logging.getLogger(__name__).exception("could not send the ledger heal")
