"""Waiting without polling: how soon ``GET /api/v1/runs/{id}/wait?until=final``
returns after the run's final transition commits, and what 500 concurrent
waiters cost the web process, on PostgreSQL + Redis with a real Celery
worker and a Daphne web process.

    .venv/bin/python bench/bench_wait.py [--samples 30] [--waiters 500]

Latency: one waiter per run of one `sleep 0.2` step; the figure is the
time the waiter got its answer minus the run's ``finished_at`` (stamped in
the final transition's transaction, just before its commit).
Waiters: N clients wait on one run of `sleep 5`; prints how many returned
SUCCEEDED and the web process's thread count (peak, and before) meanwhile.
"""

import argparse
import os
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchdb import ensure_database
from benchprocs import start_web, start_worker, stop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/execgo_bench")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/13")
os.environ.setdefault("EXECGO_DATA_DIR", str(ROOT / "var" / "bench-wait"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")
# Debug off, as deployed: the settings then want a key and host names.
os.environ.setdefault("DJANGO_SECRET_KEY", "execgo-bench-only-" + "0123456789abcdef" * 3)
os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
os.environ["EXECGO_LOG_LEVEL"] = "WARNING"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--waiters", type=int, default=500)
    args = parser.parse_args()

    ensure_database(os.environ["DATABASE_URL"])
    import django

    django.setup()
    import json

    import psutil
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from rest_framework.test import APIClient

    from execgo.celery import app
    from runs.models import Membership, Run, Tenant
    from runs.tokens import token_create

    call_command("migrate", verbosity=0)
    app.control.purge()
    tenant, _ = Tenant.objects.get_or_create(name="bench-wait")
    user, _ = User.objects.get_or_create(username="bench-wait-agent")
    Membership.objects.get_or_create(user=user, defaults={"tenant": tenant})
    token = token_create(user=user, name="bench", caller="bench")[1]
    api = APIClient()
    api.force_authenticate(user)

    data_dir = Path(os.environ["EXECGO_DATA_DIR"])
    data_dir.mkdir(parents=True, exist_ok=True)
    worker = start_worker(data_dir)
    web, port = start_web(data_dir)

    def wait(run_id: int, timeout: int = 60) -> tuple[float, dict]:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/runs/{run_id}/wait?until=final"
                                         f"&timeout={timeout}", headers={"Authorization": f"Token {token}"})
        with urllib.request.urlopen(request, timeout=timeout + 30) as response:
            body = json.loads(response.read())
        return time.time(), body

    def submit(seconds: str) -> int:
        plan = {"steps": [{"id": "s", "tool": "shell", "params": {"argv": ["sleep", seconds]}}]}
        return api.post("/api/v1/runs", {"plan": plan}, format="json").json()["id"]

    try:
        latencies = []
        for index in range(args.samples + 1):  # the first one warms up and is not counted
            answered, body = wait(submit("0.2"))
            finished = Run.objects.get(pk=body["id"]).finished_at.timestamp()
            if index:
                latencies.append((answered - finished) * 1000)
        latencies.sort()
        p95 = latencies[max(0, round(0.95 * len(latencies)) - 1)]
        print(f"wait?until=final answered after the final commit: p50 {statistics.median(latencies):.1f} ms, "
              f"p95 {p95:.1f} ms, max {latencies[-1]:.1f} ms over {len(latencies)} runs")

        server = psutil.Process(web.pid)
        before = server.num_threads()
        run_id = submit("5")
        peak = before
        with ThreadPoolExecutor(max_workers=args.waiters) as pool:
            futures = [pool.submit(wait, run_id) for _ in range(args.waiters)]
            while not all(future.done() for future in futures):
                peak = max(peak, server.num_threads())
                time.sleep(0.1)
            results = [future.result()[1] for future in futures]
        done = sum(1 for body in results if body["state"] == "SUCCEEDED" and body["reached"])
        print(f"{args.waiters} concurrent waiters on one run: {done} returned SUCCEEDED; web process threads "
              f"{before} before, {peak} at most while they waited")
    finally:
        stop(web, worker)


if __name__ == "__main__":
    main()
