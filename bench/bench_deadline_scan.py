"""What one deadline scan costs (the beat task that runs every
EXECGO_DEADLINE_SCAN_INTERVAL_S): the median and p95 of ``scan_deadlines()``
in ms, when nothing is due, over a table of mostly final runs, and the plan
of its query.

    .venv/bin/python bench/bench_deadline_scan.py [--final 100000] [--executing 200] [--scans 50]

Runs on the database DATABASE_URL names (SQLite in a temporary
EXECGO_DATA_DIR when unset), migrated first; the rows it adds are deleted
at the end, so a database is left as it was found.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchdb import ensure_database

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")
os.environ["EXECGO_LOG_LEVEL"] = "WARNING"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--final", type=int, default=100_000)
    parser.add_argument("--executing", type=int, default=200)
    parser.add_argument("--scans", type=int, default=50)
    args = parser.parse_args()
    if "DATABASE_URL" in os.environ:
        ensure_database(os.environ["DATABASE_URL"])
    else:
        os.environ["EXECGO_DATA_DIR"] = tempfile.mkdtemp(prefix="bench-deadline-")

    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection
    from django.utils import timezone

    from runs.deadlines import MIN_TIMEOUT, scan_deadlines
    from runs.models import Job, Run, Tenant
    from runs.statemachine import RunState

    call_command("migrate", verbosity=0)
    tenant = Tenant.objects.create(name=f"bench-deadline-{os.getpid()}")
    now = timezone.now()
    try:
        job = Job.objects.create(tenant=tenant)
        rows = [Run(job=job, tenant=tenant, state=RunState.SUCCEEDED, timeout_s=600, approval_timeout_s=3600,
                    last_state_change_at=now, executing_started_at=now, finished_at=now)
                for _ in range(args.final)]
        rows += [Run(job=job, tenant=tenant, state=RunState.EXECUTING, timeout_s=3600, approval_timeout_s=3600,
                     last_state_change_at=now, executing_started_at=now - timezone.timedelta(seconds=index))
                 for index in range(args.executing)]
        Run.objects.bulk_create(rows, batch_size=5000)
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("ANALYZE runs_run")
        query = Run.objects.filter(state=RunState.EXECUTING, executing_started_at__lte=now - MIN_TIMEOUT).order_by(
            "executing_started_at").only("id", "executing_started_at", "timeout_s")
        print(f"{connection.vendor}: {args.final} final runs, {args.executing} executing, none due")
        print("plan:", " | ".join(line.strip() for line in query.explain().splitlines()))
        timings = []
        for _ in range(args.scans):
            started = time.perf_counter()
            assert scan_deadlines() == []
            timings.append((time.perf_counter() - started) * 1000)
        timings.sort()
        print(f"scan_deadlines: median {statistics.median(timings):.2f} ms, "
              f"p95 {timings[int(len(timings) * 0.95) - 1]:.2f} ms over {args.scans} scans")
    finally:
        Run.objects.filter(tenant=tenant).delete()
        Job.objects.filter(tenant=tenant).delete()
        tenant.delete()


if __name__ == "__main__":
    main()
