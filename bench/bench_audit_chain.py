"""What the audit chain costs writers of one tenant: audited transactions
a second from several processes at once, all on one tenant and each on a
tenant of its own.

    .venv/bin/python bench/bench_audit_chain.py [--processes 8] [--seconds 10] [--hold-ms 1]

PostgreSQL (its own database, execgo_bench_audit) unless DATABASE_URL is
set. Each process repeats, for --seconds: a transaction that appends one
audit row through ``runs.audit.audit`` (a lane's head locked, the row
hashed and inserted, the head moved) and then holds its transaction
--hold-ms longer (``pg_sleep``: the rest of a transition's statements,
which run after its audit row and before its commit while the head stays
locked). Three measurements: one tenant with one caller lane
(EXECGO_AUDIT_LANES=1: every writer of the tenant on one head, as before
lanes), one tenant with the configured lanes (default 32), and a tenant
each. Prints transactions a second and the 50th and 99th percentile of a
transaction's time for each, and the ratio of one tenant's throughput to
a tenant each's: near 1, the chain does not serialise the writers; near
1/--processes, it does.
"""

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/execgo_bench_audit")
os.environ.setdefault("EXECGO_DATA_DIR", str(ROOT / "var" / "bench-audit"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", "execgo-bench-only-" + "0123456789abcdef" * 3)
os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
os.environ["EXECGO_LOG_LEVEL"] = "WARNING"


def writer(tenant_id: int, seconds: float, hold_s: float, start_at: float, out) -> None:
    import django

    django.setup()
    from django.db import connection, transaction

    from runs.audit import audit
    from runs.models import AuditEvent

    times = []
    while time.time() < start_at:
        time.sleep(0.001)
    end = start_at + seconds
    while time.time() < end:
        began = time.perf_counter()
        with transaction.atomic():
            audit(AuditEvent.STATE_CHANGED, run_id=None, tenant_id=tenant_id, caller="bench",
                  from_state="A", to_state="B", data={"n": len(times)})
            if hold_s:
                with connection.cursor() as cursor:
                    cursor.execute("SELECT pg_sleep(%s)", [hold_s])
        times.append(time.perf_counter() - began)
    out.put(times)


def measure(tenants: list[int], seconds: float, hold_s: float) -> tuple[float, float, float]:
    from benchload import percentiles

    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    start_at = time.time() + 3.0  # every process set up before the first write
    processes = [context.Process(target=writer, args=(tenant, seconds, hold_s, start_at, out)) for tenant in tenants]
    for process in processes:
        process.start()
    samples = [out.get(timeout=seconds + 120) for _ in processes]
    for process in processes:
        process.join()
    every = [t * 1000 for times in samples for t in times]
    points = percentiles(every, (50, 99))
    return len(every) / seconds, points[50], points[99]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--hold-ms", type=float, default=1.0, help="the transaction's time after its audit row")
    args = parser.parse_args()

    from benchdb import ensure_database

    ensure_database(os.environ["DATABASE_URL"])
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command

    from runs.models import Tenant

    call_command("migrate", verbosity=0)
    tenants = [Tenant.objects.get_or_create(name=f"bench-audit-{index}")[0].pk for index in range(args.processes)]
    hold_s = args.hold_ms / 1000
    lanes = os.environ.get("EXECGO_AUDIT_LANES", "")
    os.environ["EXECGO_AUDIT_LANES"] = "1"  # the spawned writers read it at their start
    one_lane = measure([tenants[0]] * args.processes, args.seconds, hold_s)
    os.environ["EXECGO_AUDIT_LANES"] = lanes or str(settings.EXECGO_AUDIT_LANES)
    one = measure([tenants[0]] * args.processes, args.seconds, hold_s)
    own = measure(tenants, args.seconds, hold_s)
    print(f"{args.processes} processes appending audit rows for {args.seconds:g} s, each transaction held "
          f"{args.hold_ms:g} ms after its row ({os.environ['DATABASE_URL'].split(':')[0]}, "
          f"{os.cpu_count()} CPUs)")
    for label, (rate, p50, p99) in (("one tenant, 1 lane", one_lane),
                                    (f"one tenant, {os.environ['EXECGO_AUDIT_LANES']} lanes", one),
                                    ("a tenant each", own)):
        print(f"  {label}: {rate:.0f} transactions/s, p50 {p50:.1f} ms, p99 {p99:.1f} ms")
    print(f"  one tenant / a tenant each: {one_lane[0] / own[0]:.2f} of the throughput with 1 lane, "
          f"{one[0] / own[0]:.2f} with {os.environ['EXECGO_AUDIT_LANES']}")


if __name__ == "__main__":
    main()
