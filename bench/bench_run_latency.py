"""Wall time from POST /api/v1/runs to SUCCEEDED for a 40-step sequential
`true` plan, on PostgreSQL + Redis with a real Celery worker process.

    .venv/bin/python bench/bench_run_latency.py [--steps 40] [--repeat 7]

Uses its own database (execgo_bench) and Redis db 13 unless DATABASE_URL /
CELERY_BROKER_URL are set. The database is kept from one invocation to the
next, as a deployment's is (dropping and re-creating it right before each
invocation measured markedly slower here). Prints every sample with where its time went
(POST to the first step's start, the steps, the last step's end to
SUCCEEDED), then the median, p95 and best, the machine's CPU a step cost by
who spent it (``benchcpu``), and references for the machine's
speed at the time, before and after: a bare posix_spawn + wait of /bin/true
and a PostgreSQL round trip (small VMs change speed from minute to minute;
compare figures with them).
"""

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchcpu import CpuSample, cpu_line
from benchdb import ensure_database

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/execgo_bench")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/13")
os.environ.setdefault("EXECGO_DATA_DIR", str(ROOT / "var" / "bench"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")
# Debug off, as deployed: the settings then want a key and host names.
os.environ.setdefault("DJANGO_SECRET_KEY", "execgo-bench-only-" + "0123456789abcdef" * 3)
os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
os.environ["EXECGO_LOG_LEVEL"] = "WARNING"


# The end of a run is read from its row (``finished_at`` is stamped in the
# final transition's transaction), so the poll can be slow: a tight poll
# would take CPU from the worker and the database on a small machine.
POLL_S = 0.05


def machine_reference(n: int = 300) -> str:
    """Medians of a bare posix_spawn + wait of /bin/true and of a database
    round trip (``SELECT 1``)."""
    from django.db import connection

    spawn, round_trip = [], []
    with connection.cursor() as cursor:
        for _ in range(n):
            start = time.perf_counter()
            os.waitpid(os.posix_spawn("/bin/true", ["/bin/true"], {}), 0)
            spawn.append((time.perf_counter() - start) * 1000)
            start = time.perf_counter()
            cursor.execute("SELECT 1")
            cursor.fetchone()
            round_trip.append((time.perf_counter() - start) * 1_000_000)
    return f"spawn of true {statistics.median(spawn):.2f} ms, database round trip {statistics.median(round_trip):.0f} µs"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--profile", choices=["linux_sandbox", "process"], default=None,
                        help="the steps' sandbox profile (default: none named, as an agent's steps usually are)")
    args = parser.parse_args()

    ensure_database(os.environ["DATABASE_URL"])
    import django

    django.setup()
    from django.core.management import call_command

    from execgo.celery import app
    from runs.models import Step

    call_command("migrate", verbosity=0)
    app.control.purge()
    client = agent_client()

    worker_log = open(Path(os.environ["EXECGO_DATA_DIR"]) / "bench-worker.log", "wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "execgo", "worker", "-P", "prefork", "-c", "2",
         "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING"],
        cwd=ROOT, env=os.environ.copy(), stdout=worker_log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        sandbox = {"sandbox": {"profile": args.profile}} if args.profile else {}
        plan = {"steps": [{"id": f"s{i}", "tool": "shell", "params": {"argv": ["true"]}, **sandbox,
                           **({"depends_on": [f"s{i - 1}"]} if i else {})} for i in range(args.steps)]}
        samples, parts = [], []
        reference_before = machine_reference()
        cpu_before = None
        for index in range(args.repeat + 1):  # the first run warms the worker up and is not counted
            run_id, started_at, finished_at = post_and_wait(client, plan)
            elapsed = finished_at - started_at
            if not index:
                cpu_before = CpuSample()
            else:
                samples.append(elapsed)
                first_start, last_end = _step_span(Step, run_id)
                part = (first_start - started_at, (last_end - first_start) / args.steps,
                        finished_at - last_end)
                parts.append(part)
                print(f"run {run_id}: {args.steps} steps POST -> SUCCEEDED in {elapsed * 1000:.1f} ms "
                      f"(first step started after {part[0] * 1000:.1f} ms, {part[1] * 1000:.2f} ms a step, "
                      f"closed {part[2] * 1000:.1f} ms after the last)")
        cpu_after = CpuSample()
        median_part = [statistics.median(part[i] for part in parts) * 1000 for i in range(3)]
        p95 = statistics.quantiles(samples, n=20)[-1] if len(samples) > 1 else samples[0]
        print(f"median {statistics.median(samples) * 1000:.1f} ms, p95 {p95 * 1000:.1f} ms, "
              f"best {min(samples) * 1000:.1f} ms "
              f"over {len(samples)} runs ({args.steps} sequential `true` steps, "
              f"{os.environ['DATABASE_URL'].split(':')[0]} + {os.environ['CELERY_BROKER_URL'].split(':')[0]}); "
              f"medians: first step after {median_part[0]:.1f} ms, {median_part[1]:.2f} ms a step, "
              f"closed {median_part[2]:.1f} ms after the last step")
        print(cpu_line(cpu_after.since(cpu_before), args.steps * len(samples), "step", cpu_after.at - cpu_before.at)
              + " (the web's part is the bench's: it POSTs in-process)")
        print(f"machine reference before: {reference_before}; after: {machine_reference()}")
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=30)


def agent_client():
    """An API client signed in as the bench's agent (tenant "bench"), in-process."""
    from django.contrib.auth.models import User
    from rest_framework.test import APIClient

    from runs.models import Membership, Tenant

    tenant, _ = Tenant.objects.get_or_create(name="bench")
    user, _ = User.objects.get_or_create(username="bench-agent")
    Membership.objects.get_or_create(user=user, defaults={"tenant": tenant})
    client = APIClient()
    client.force_authenticate(user)
    return client


def post_and_wait(client, plan: dict) -> tuple[int, float, float]:
    """POSTs a run of ``plan`` and waits for it to SUCCEED: its id, when the
    POST was sent and the run's finished_at (epoch seconds)."""
    from runs.models import Run

    started, started_at = time.perf_counter(), time.time()
    response = client.post("/api/v1/runs", {"plan": plan}, format="json")
    assert response.status_code == 201, response.content
    run_id = response.json()["id"]
    while True:
        state, finished_at = Run.objects.filter(pk=run_id).values_list("state", "finished_at").get()
        if state in {"SUCCEEDED", "CLOSED_FAILED", "CLOSED_REJECTED", "CLOSED_CANCELLED"}:
            break
        if time.perf_counter() - started > 120:
            raise SystemExit(f"run {run_id} stuck in {state}")
        time.sleep(POLL_S)
    if state != "SUCCEEDED":
        raise SystemExit(f"run {run_id} ended {state}")
    return run_id, started_at, finished_at.timestamp()


def _step_span(step_model, run_id: int) -> tuple[float, float]:
    """When the run's first step started and its last step finished (epoch seconds)."""
    steps = step_model.objects.filter(run_id=run_id)
    first = steps.order_by("started_at").values_list("started_at", flat=True).first()
    last = steps.order_by("-finished_at").values_list("finished_at", flat=True).first()
    return first.timestamp(), last.timestamp()


if __name__ == "__main__":
    main()
