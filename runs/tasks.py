from celery import shared_task

from runs.pipeline import run_advance


@shared_task(acks_late=True, ignore_result=True)
def advance_run(run_id: int) -> None:
    """Drive a run forward. Safe to deliver twice: every stage re-reads the
    run and every write is a compare-and-swap."""
    run_advance(run_id)


@shared_task(ignore_result=True)
def sweep_zombie_runs() -> None:
    from runs.sweeper import sweep_zombies

    sweep_zombies()
