"""The transaction a sequential chain runs between two of its steps, through
the ORM and through the compiled statements of ``runtime.statements``: the
median and p95 of one transaction, in µs.

    .venv/bin/python bench/bench_statements.py [--iterations 2000] [--seconds 5] [--both]

The transaction: lock the run row, the fenced update of the finished step,
the start of the next step, the hand-over of the finished step's reservation
to it and two events. Each path walks a chain of its own, a step a
transaction, so every write matches a row as in a real chain and nothing is
reset between transactions. The two paths alternate, transaction by
transaction, so a small VM changing speed meanwhile skews both alike; they
stop early, at the same count, when ``--seconds`` run out (PostgreSQL syncs
every commit to disk, a millisecond or more here).

Runs on the database DATABASE_URL names (SQLite in a temporary
EXECGO_DATA_DIR when unset); ``--both`` runs once on SQLite and once on
PostgreSQL at 127.0.0.1:5432, in a database of its own
(execgo_bench_statements, created and migrated when missing: never the test
suite's), and leaves it as it found it.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchdb import ensure_database

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")
# Debug off, as deployed: the settings then want a key and host names.
os.environ.setdefault("DJANGO_SECRET_KEY", "execgo-bench-only-" + "0123456789abcdef" * 3)
os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
os.environ["EXECGO_LOG_LEVEL"] = "WARNING"

from runs.step_lifecycle import placing_steps  # noqa: E402

POSTGRES_URL = "postgres://postgres@127.0.0.1:5432/execgo_bench_statements"
HOST = "bench-statements"
RESULT = {"status": "success", "output": {"stdout": "ok\n", "exit_code": 0}, "error": None, "duration_ms": 3}
PLAN = {"profile": "process", "limits": {"timeout_s": 5, "log_cap_bytes": 1048576}}
AMOUNTS = {"task_slots": 1, "memory_bytes": 0, "pids": 0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=5, help="stop earlier when these are spent")
    parser.add_argument("--both", action="store_true", help="once on SQLite, once on PostgreSQL")
    parser.add_argument("--no-header", action="store_true", help="rows only (what --both runs)")
    args = parser.parse_args()
    if args.both:
        run_both(args.iterations, args.seconds)
        return
    os.environ.setdefault("EXECGO_DATA_DIR", tempfile.mkdtemp(prefix="execgo-bench-statements-"))
    ensure_database(os.environ.get("DATABASE_URL", ""))
    if not args.no_header:
        print_header()
    print_rows(*measure(args.iterations, args.seconds))


def run_both(iterations: int, seconds: float) -> None:
    print_header()
    for database_url in (None, POSTGRES_URL):
        with tempfile.TemporaryDirectory(prefix="execgo-bench-statements-") as data_dir:
            env = {key: value for key, value in os.environ.items() if key != "DATABASE_URL"}
            env["EXECGO_DATA_DIR"] = data_dir
            if database_url:
                env["DATABASE_URL"] = database_url
            subprocess.run([sys.executable, __file__, "--iterations", str(iterations), "--seconds", str(seconds),
                            "--no-header"], env=env, check=True)
    print("n: transactions timed a path; ratio: the path's median over the compiled path's")


def print_header() -> None:
    print(f"{'database':<12}{'path':<10}{'n':>6}{'median µs':>11}{'p95 µs':>10}{'ratio':>8}")


def print_rows(vendor: str, samples: dict[str, list[float]]) -> None:
    compiled = statistics.median(samples["compiled"])
    for path, times in samples.items():
        median = statistics.median(times)
        p95 = statistics.quantiles(times, n=20)[18]
        print(f"{vendor:<12}{path:<10}{len(times):>6}{median:>11.0f}{p95:>10.0f}{median / compiled:>8.2f}")


@placing_steps()  # the two paths write the step statuses of a chain directly: what they cost is measured
def measure(iterations: int, seconds: float) -> tuple[str, dict[str, list[float]]]:
    import django

    django.setup()
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.db import connection, transaction
    from django.utils import timezone

    from runs.models import Event, Job, Run, Step, Tenant
    from runs.transitions import RUN_FIELDS
    from runtime import statements
    from runtime.models import HostCapacity, Reservation

    call_command("migrate", verbosity=0)
    tenant, _ = Tenant.objects.get_or_create(name="bench-statements")
    user, _ = User.objects.get_or_create(username="bench-statements")
    HostCapacity.objects.get_or_create(host=HOST, defaults={"task_slots_capacity": 64, "memory_bytes_capacity": 2**40,
                                                            "pids_capacity": 4096})
    warm_up = min(100, iterations // 10)

    def chain(length: int) -> tuple[Run, list[int]]:
        """A run executing its first step (which holds a reservation); the
        others pending."""
        now = timezone.now()
        job = Job.objects.create(tenant=tenant, created_by=user)
        run = Run.objects.create(job=job, tenant=tenant, submitted_by=user, state="EXECUTING", timeout_s=3600,
                                 approval_timeout_s=3600, last_state_change_at=now, executing_started_at=now)
        Step.objects.bulk_create([
            Step(run=run, step_id=f"s{index}", position=index, tool="shell", params={"argv": ["true"]}, timeout_s=5,
                 **({"status": "running", "run_status": "running", "attempt": 1, "handle_id": handle(run, 0)}
                    if index == 0 else {}))
            for index in range(length)])
        Reservation.objects.create(host_id=HOST, handle_id=handle(run, 0))
        return run, list(Step.objects.filter(run=run).order_by("position").values_list("pk", flat=True))

    def handle(run: Run, index: int) -> str:
        return f"bench-{run.pk}-{index}"

    def writes(run: Run, steps: list[int], index: int) -> tuple:
        """What the step-boundary transaction writes: the fence, the finished
        step's result, the next step's start, the reservation hand-over and
        the events."""
        stamp, finished, following = timezone.now(), handle(run, index), handle(run, index + 1)
        return ({"id": steps[index], "attempt": 1, "run_status": "running"},
                {"run_status": "success", "result": RESULT, "finished_at": stamp, "status": "success",
                 "progress": 100},
                {"id": steps[index + 1], "status": "pending", "run_status": ""},
                {"status": "running", "run_status": "running", "attempt": 1, "handle_id": following, "host": HOST,
                 "started_at": stamp, "effective_plan": PLAN},
                {"handle_id": finished, "host_id": HOST, **AMOUNTS},
                {"handle_id": following, "reserved_at": stamp, "waited_ms": 0},
                [Event(type="task_succeeded", run=run, task_id=f"s{index}", handle_id=finished, timestamp=stamp,
                       message="succeeded", data={"attempt": 1, "duration_ms": 3}),
                 Event(type="task_started", run=run, task_id=f"s{index + 1}", handle_id=following, timestamp=stamp,
                       message="started", data={"attempt": 1, "host": HOST, "plan": PLAN})])

    def compiled(run: Run, steps: list[int], index: int) -> tuple[int, ...]:
        fence, result, pending, start, reserved, handover, events = writes(run, steps, index)
        with transaction.atomic():
            statements.select_for_update(Run, run.pk, RUN_FIELDS)
            changed = (statements.update(Step, fence, result), statements.update(Step, pending, start),
                       statements.update(Reservation, reserved, handover))
            statements.insert(events)
        return changed

    def orm(run: Run, steps: list[int], index: int) -> tuple[int, ...]:
        fence, result, pending, start, reserved, handover, events = writes(run, steps, index)
        with transaction.atomic():
            Run.objects.select_for_update().only(*RUN_FIELDS).get(pk=run.pk)
            changed = (Step.objects.filter(**fence).update(**result), Step.objects.filter(**pending).update(**start),
                       Reservation.objects.filter(**reserved).update(**handover))
            Event.objects.bulk_create(events)
        return changed

    paths = {"orm": (orm, *chain(warm_up + iterations + 1)), "compiled": (compiled, *chain(warm_up + iterations + 1))}
    samples: dict[str, list[float]] = {path: [] for path in paths}
    deadline = time.monotonic() + seconds
    for index in range(warm_up + iterations):
        for path, (transaction_of, run, steps) in paths.items():
            started = time.perf_counter_ns()
            changed = transaction_of(run, steps, index)
            elapsed = time.perf_counter_ns() - started
            assert changed == (1, 1, 1), (path, index, changed)
            if index >= warm_up:
                samples[path].append(elapsed / 1000)
        if index >= warm_up + 20 and time.monotonic() > deadline:
            break
    for _, run, _ in paths.values():
        # The database is kept from one invocation to the next: leave it as found.
        Reservation.objects.filter(handle_id__startswith=f"bench-{run.pk}-").delete()
        run.delete()  # with its steps and events
        run.job.delete()
    return connection.vendor, samples


if __name__ == "__main__":
    main()
