"""What observability costs: the median and p95 of one /metrics scrape (the
database read at scrape time plus the sum of every process's files), and
of formatting one JSON log line with its bound ids and redaction.

    .venv/bin/python bench/bench_metrics_scrape.py [--runs 20000] [--processes 50] [--scrapes 50]

Runs on SQLite in a temporary EXECGO_DATA_DIR (DATABASE_URL unset), with
``--runs`` runs spread over every state (placed directly, as the tests'
factory does) and ``--processes`` processes that counted and exited (their
files are folded at the first scrape, as a deployment's are).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

COUNT_AND_EXIT = """
import django; django.setup()
from runs import metrics
for edge in [("CREATED", "PREPARING"), ("PREPARING", "PLANNING"), ("EXECUTING", "TRACING")]:
    metrics.TRANSITIONS.labels(*edge).inc()
metrics.STEP_DURATION.labels("shell", "success").observe(0.3)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20000)
    parser.add_argument("--processes", type=int, default=50)
    parser.add_argument("--scrapes", type=int, default=50)
    args = parser.parse_args()
    data_dir = tempfile.mkdtemp(prefix="execgo-bench-metrics-")
    os.environ.update(EXECGO_DATA_DIR=data_dir, DJANGO_SETTINGS_MODULE="execgo.settings",
                      EXECGO_METRICS_TOKEN="bench-scraper-token")
    os.environ.pop("DATABASE_URL", None)
    sys.path.insert(0, str(ROOT))
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, check=True)
    for _ in range(args.processes):
        subprocess.run([sys.executable, "-c", COUNT_AND_EXIT], cwd=ROOT, check=True)

    import django

    django.setup()
    import logging

    from django.contrib.auth.models import User
    from django.test import Client
    from django.utils import timezone
    from structlog.contextvars import bind_contextvars

    from execgo.logs import json_formatter
    from runs.models import Job, Run, Tenant
    from runs.statemachine import RunState

    tenant = Tenant.objects.create(name="bench")
    user = User.objects.create(username="bench")
    job = Job.objects.create(tenant=tenant, created_by=user)
    now = timezone.now()
    states = list(RunState.values)
    Run.objects.bulk_create([
        Run(job=job, tenant=tenant, submitted_by=user, state=states[n % len(states)], plan={"steps": []},
            timeout_s=600, approval_timeout_s=3600, last_state_change_at=now,
            closing_cause="succeeded" if states[n % len(states)] == "SUCCEEDED" else "")
        for n in range(args.runs)
    ], batch_size=2000)

    client = Client()
    timings = []
    for _ in range(args.scrapes + 1):
        started = time.perf_counter()
        assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer bench-scraper-token").status_code == 200
        timings.append((time.perf_counter() - started) * 1000)
    first, rest = timings[0], sorted(timings[1:])
    print(f"/metrics with {args.runs} runs and {args.processes} exited processes: first scrape (folding) "
          f"{first:.1f} ms; then median {statistics.median(rest):.1f} ms, p95 {rest[int(len(rest) * 0.95) - 1]:.1f} ms")

    formatter = json_formatter()
    bind_contextvars(request_id="bench", run_id=1, step_id="s1", handle_id="h-1-s1-1", tenant_id=1)
    for label, message in (("a plain line", "step %s finished in %s ms"),
                           ("a line with a token to redact", "step %s sent Authorization: Token %s")):
        record = logging.LogRecord("runs.execution", logging.INFO, __file__, 1, message,
                                   ("s1", "0123456789abcdef"), None)
        n = 20000
        started = time.perf_counter()
        for _ in range(n):
            formatter.format(record)
        print(f"one JSON log line, {label} (5 bound ids): {(time.perf_counter() - started) / n * 1e6:.1f} µs")

if __name__ == "__main__":
    main()
