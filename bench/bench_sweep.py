"""The zombie sweeper at scale: 1,000,000 runs on PostgreSQL, 1,000 of them
stuck; the time of the sweeper's query, of a sweep that closes the 1,000,
and of the next (idle) sweep, with the EXPLAIN ANALYZE of the query.

    .venv/bin/python bench/bench_sweep.py [--runs 1000000] [--stuck 1000] [--live 2000]

Runs in a database of its own (execgo_bench_sweep at 127.0.0.1:5432, or
DATABASE_URL), created and migrated when missing, never the test suite's.
The rows are bench fixtures, bulk-inserted with INSERT … SELECT
generate_series (not through the state machine): final runs to fill the
table up to --runs (once; kept between invocations), --live runs that are
EXECUTING or AWAITING_HITL and fresh (not stuck), and --stuck runs spread
over every non-final state and past their thresholds (new ones each time:
the sweep closes them).
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from benchdb import ensure_database

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/execgo_bench_sweep")
os.environ.setdefault("EXECGO_DATA_DIR", tempfile.mkdtemp(prefix="execgo-bench-sweep-"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/11")
# Debug off, as deployed: the settings then want a key and host names.
os.environ.setdefault("DJANGO_SECRET_KEY", "execgo-bench-only-" + "0123456789abcdef" * 3)
os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
os.environ["EXECGO_LOG_LEVEL"] = "WARNING"

FINAL = ("SUCCEEDED", "CLOSED_FAILED", "CLOSED_REJECTED", "CLOSED_CANCELLED")
# Every state the sweeper forces, and how long ago the stuck ones changed.
STUCK = ("CREATED", "PREPARING", "PLANNING", "POLICY_CHECK", "AWAITING_HITL", "EXECUTING", "TRACING",
         "REJECTED", "FAILED", "TIMEOUT", "CANCELLED")
CAUSE = {"REJECTED": "rejected", "FAILED": "failed", "TIMEOUT": "run_timeout", "CANCELLED": "cancelled"}


def insert_runs(cursor, *, count: int, states: tuple[str, ...], age_s: int, title: str, tenant: int, job: int) -> None:
    """``count`` runs cycling through ``states``, last changed ``age_s`` ago."""
    cases = " ".join(f"WHEN {i} THEN '{state}'" for i, state in enumerate(states))
    causes = " ".join(f"WHEN '{state}' THEN '{cause}'" for state, cause in CAUSE.items())
    cursor.execute(f"""
        INSERT INTO runs_run (job_id, tenant_id, title, state, previous_state, closing_cause, planner, goal, plan,
                              timeout_s, approval_timeout_s, idempotency_fingerprint, callback_url, callback_events,
                              context, created_at, last_state_change_at, executing_started_at, finished_at)
        SELECT %s, %s, %s, s.state, '', COALESCE(CASE s.state {causes} END, ''), 'static', '',
               '{{"steps": [{{"id": "a", "tool": "shell", "params": {{"argv": ["true"]}}}}]}}'::jsonb,
               600, 3600, '', '', '[]'::jsonb, '{{}}'::jsonb,
               now() - make_interval(secs => %s), now() - make_interval(secs => %s),
               CASE WHEN s.state = 'EXECUTING' THEN now() - make_interval(secs => %s) END,
               CASE WHEN s.state IN {FINAL} THEN now() - make_interval(secs => %s) END
        FROM (SELECT CASE g %% {len(states)} {cases} END AS state FROM generate_series(1, %s) AS g) AS s
    """, [job, tenant, title, age_s, age_s, age_s, age_s, count])


def populate(args) -> tuple[int, int]:
    from django.db import connection

    from runs.models import Job, Tenant

    tenant, _ = Tenant.objects.get_or_create(name="bench-sweep")
    job = Job.objects.filter(tenant=tenant).first() or Job.objects.create(tenant=tenant, title="bench-sweep")
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM runs_run WHERE title = 'bench-filler'")
        fillers = cursor.fetchone()[0]
        missing = args.runs - args.stuck - args.live - fillers
        if missing > 0:
            started = time.perf_counter()
            insert_runs(cursor, count=missing, states=FINAL, age_s=86400, title="bench-filler", tenant=tenant.pk,
                        job=job.pk)
            print(f"inserted {missing:,} final runs in {time.perf_counter() - started:.1f} s")
        cursor.execute("SELECT count(*) FROM runs_run WHERE title = 'bench-live' AND state IN "
                       "('EXECUTING', 'AWAITING_HITL')")
        live = cursor.fetchone()[0]
        if live < args.live:
            insert_runs(cursor, count=args.live - live, states=("EXECUTING", "AWAITING_HITL"), age_s=1,
                        title="bench-live", tenant=tenant.pk, job=job.pk)
        # Fresh again: only the stuck ones are past their thresholds.
        cursor.execute("UPDATE runs_run SET last_state_change_at = now(), executing_started_at = "
                       "CASE WHEN state = 'EXECUTING' THEN now() END WHERE title = 'bench-live'")
        insert_runs(cursor, count=args.stuck, states=STUCK, age_s=7 * 86400, title="bench-stuck",
                    tenant=tenant.pk, job=job.pk)
        cursor.execute("ANALYZE runs_run")
        cursor.execute("SELECT count(*) FROM runs_run")
        total = cursor.fetchone()[0]
    return total, tenant.pk


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--stuck", type=int, default=1000)
    parser.add_argument("--live", type=int, default=2000, help="non-final runs that are not stuck")
    parser.add_argument("--inline", action="store_true",
                        help="close the stuck runs in this process (the sweep without workers) instead of handing "
                             "them to a real worker (2 pool processes)")
    args = parser.parse_args()
    if not os.environ["DATABASE_URL"].startswith("postgres"):
        sys.exit("bench_sweep.py measures PostgreSQL: DATABASE_URL must be postgres://…")
    ensure_database(os.environ["DATABASE_URL"])

    import django
    from django.core.management import call_command
    django.setup()
    call_command("migrate", verbosity=0)

    from django.db import connection
    from django.utils import timezone

    from runs.models import Run
    from runs.statemachine import FINAL as FINAL_STATES
    from runs.sweeper import stuck_candidates, sweep_zombies

    total, tenant = populate(args)
    stuck = Run.objects.filter(tenant_id=tenant, title="bench-stuck").exclude(state__in=FINAL_STATES).count()
    print(f"{total:,} runs, {stuck:,} stuck, {args.live:,} live (database {connection.settings_dict['NAME']})")

    now = timezone.now()
    print("\nEXPLAIN ANALYZE of the sweeper's query:")
    print(stuck_candidates(now).explain(analyze=True, buffers=True))

    started = time.perf_counter()
    candidates = list(stuck_candidates(now))
    query_s = time.perf_counter() - started

    if args.inline:
        started = time.perf_counter()
        recovered = sweep_zombies()
        sweep_s = time.perf_counter() - started
        print(f"\nsweep closing {len(recovered):,} stuck runs itself: {sweep_s:.2f} s "
              f"({sweep_s / max(len(recovered), 1) * 1000:.1f} ms a run)")
    else:
        from benchprocs import start_worker, stop
        from celery import current_app
        from django.conf import settings

        current_app.control.purge()
        started = time.perf_counter()
        handed = sweep_zombies(inline_max=settings.EXECGO_SWEEP_INLINE_MAX)
        sweep_s = time.perf_counter() - started
        print(f"\nsweep (the beat task): {sweep_s * 1000:.1f} ms, {len(handed):,} stuck runs handed to the workers")
        worker = start_worker(Path(os.environ["EXECGO_DATA_DIR"]))
        try:
            started = time.perf_counter()
            while Run.objects.filter(pk__in=handed).exclude(state__in=FINAL_STATES).exists():
                if time.perf_counter() - started > 600:
                    sys.exit("the worker did not close them within 600 s")
                time.sleep(0.1)
            print(f"a worker with 2 pool processes closed them {time.perf_counter() - started:.2f} s after it started")
        finally:
            stop(worker)

    started = time.perf_counter()
    again = sweep_zombies()
    idle_s = time.perf_counter() - started

    left = Run.objects.filter(tenant_id=tenant, title="bench-stuck").exclude(state__in=FINAL_STATES).count()
    print(f"sweeper query: {query_s * 1000:.1f} ms for {len(candidates):,} candidates; stuck left: {left}")
    print(f"next sweep (nothing stuck, {args.live:,} live): {idle_s * 1000:.1f} ms, {len(again)} recovered")


if __name__ == "__main__":
    main()
