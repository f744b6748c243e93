"""Celery tasks: ids in, re-fetch, call one service. Each is safe to deliver
twice: the services re-read the rows and claim work by compare-and-swap."""

from celery import shared_task

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
