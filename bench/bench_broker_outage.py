"""A broker outage, measured: the broker (a redis-server of this bench's own,
on a free port, keeping nothing) is killed while runs are queued and submits
go on, then restarted empty. Prints what every submit was answered, how
every accepted run ended, how many were sent again by the sweeper and how
long the backlog took to drain.

    .venv/bin/python bench/bench_broker_outage.py [--queued 40] [--outage 20] [--rate 4]

PostgreSQL (its own database, execgo_bench_outage, unless DATABASE_URL is
set), a Daphne web process, a `-c 2` worker and beat, all real. The target:
every submit answered 201 (and its run SUCCEEDED) or 503 retryable (and
nothing committed), and no run CLOSED_FAILED for the outage.
"""

import argparse
import collections
import os
import subprocess
import sys
import time
from pathlib import Path

from benchdb import ensure_database
from benchprocs import _start, free_port, start_web, start_worker, stop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/execgo_bench_outage")
os.environ.setdefault("EXECGO_DATA_DIR", str(ROOT / "var" / "bench-outage"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", "execgo-bench-only-" + "0123456789abcdef" * 3)
os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
os.environ["EXECGO_LOG_LEVEL"] = "WARNING"
# The sweeper looks every 2 s; a run whose message died with the broker is sent again after 10 s.
os.environ.update(EXECGO_SWEEP_INTERVAL_S="2", EXECGO_ZOMBIE_CREATED_S="10", EXECGO_ZOMBIE_EXECUTING_IDLE_S="10")

FINAL = {"SUCCEEDED", "CLOSED_FAILED", "CLOSED_REJECTED", "CLOSED_CANCELLED"}
PLAN = {"steps": [{"id": "nap", "tool": "shell", "params": {"argv": ["sleep", "1"]}}]}


def start_redis(port: int, data_dir: Path) -> subprocess.Popen:
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", str(data_dir)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.STDOUT, start_new_session=True)
    while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True).stdout.strip() != "PONG":
        time.sleep(0.05)
    return redis


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--queued", type=int, default=40, help="runs submitted (and queued) before the outage")
    parser.add_argument("--outage", type=float, default=20.0, help="seconds the broker stays down")
    parser.add_argument("--rate", type=float, default=4.0, help="submits a second during and after the outage")
    args = parser.parse_args()

    data_dir = Path(os.environ["EXECGO_DATA_DIR"])
    data_dir.mkdir(parents=True, exist_ok=True)
    redis_port = free_port()
    os.environ["CELERY_BROKER_URL"] = f"redis://127.0.0.1:{redis_port}/0"
    ensure_database(os.environ["DATABASE_URL"])
    import django

    django.setup()
    import httpx
    from django.contrib.auth.models import User
    from django.core.management import call_command

    from runs.models import AuditLog, Dispatch, Membership, Run, Tenant
    from runs.tokens import token_create

    call_command("migrate", verbosity=0)
    tenant, _ = Tenant.objects.get_or_create(name="bench-outage")
    user, _ = User.objects.get_or_create(username="bench-outage-agent")
    Membership.objects.get_or_create(user=user, defaults={"tenant": tenant})
    token = token_create(user=user, name="bench", caller="bench")[1]
    first_run = (Run.objects.order_by("-pk").values_list("pk", flat=True).first() or 0) + 1

    redis = start_redis(redis_port, data_dir)
    worker = start_worker(data_dir)
    beat = _start([sys.executable, "-m", "celery", "-A", "execgo", "beat", "-l", "WARNING"], data_dir / "bench-beat.log")
    web, port = start_web(data_dir)
    answers: collections.Counter = collections.Counter()
    accepted: list[int] = []
    try:
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60,
                              headers={"Authorization": f"Token {token}"})
        time.sleep(5)  # the worker ready, beat's first ticks

        def submit(phase: str) -> None:
            response = client.post("/api/v1/runs", json={"title": phase, "plan": PLAN})
            retryable = response.status_code == 503 and response.json()["error"]["retryable"]
            answers[(phase, response.status_code, retryable)] += 1
            if response.status_code == 201:
                accepted.append(response.json()["id"])

        for _ in range(args.queued):
            submit("before")
        redis.kill()
        redis.wait()
        down_at = time.monotonic()
        while time.monotonic() - down_at < args.outage:
            submit("during")
            time.sleep(1 / args.rate)
        redis = start_redis(redis_port, data_dir)  # empty
        up_at = time.monotonic()
        for _ in range(int(args.rate * 5)):
            submit("after")
            time.sleep(1 / args.rate)
        while Run.objects.filter(pk__in=accepted).exclude(state__in=FINAL).exists():
            if time.monotonic() - up_at > 300:
                break
            time.sleep(0.5)
        drained_s = time.monotonic() - up_at
    finally:
        stop(web, beat, worker)
        redis.kill()

    print(f"broker down {args.outage:.0f} s with {args.queued} runs queued; submits at {args.rate:g}/s during and after")
    for (phase, code, retryable), count in sorted(answers.items()):
        print(f"  {phase:<6} answered {code}{' retryable' if retryable else ''}: {count}")
    states = collections.Counter(Run.objects.filter(pk__in=accepted).values_list("state", flat=True))
    print(f"  accepted runs: {len(accepted)}; final states: {dict(states)}")
    resent = AuditLog.objects.filter(event="work_resent", run_id__gte=first_run).values("run_id").distinct().count()
    print(f"  runs sent again by the sweeper: {resent}; outbox rows left: {Dispatch.objects.count()}")
    print(f"  every accepted run final {drained_s:.1f} s after the broker came back")


if __name__ == "__main__":
    main()
