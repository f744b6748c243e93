"""A steady crowd of slow runs: 50 runs in flight at all times, each of one
shell step `sleep 1`, for a fixed time, on a `-c 2` worker. Measures what
gets through (runs a second), how long a run waits behind the others (POST
to final) and how many steps the worker actually ran at once.

    .venv/bin/python bench/bench_mixed.py [--seconds 60] [--inflight 50] [--concurrency 2] [--tail 120] [--quick]

A Daphne web process and a Celery worker, both real, on PostgreSQL (its own
database, execgo_bench_mixed) and Redis db 12, unless DATABASE_URL /
CELERY_BROKER_URL are set; debug off; no beat. One agent (an "agents" user
with a new API token) submits over HTTP; closed loop: a run is submitted
each time one of the --inflight in flight becomes final (the bench reads
the runs' rows every 0.1 s), until the window ends. The runs then in flight
are waited for, --tail seconds at most. --quick: a 15 s window, a smoke test.

Prints the runs final within the window and their rate, the runs final in
all and their states, the 50th and 95th percentiles of POST to final (the
run's finished_at less the moment its POST was sent, every run submitted),
and the most steps running at one instant (from the steps' started_at and
finished_at), with the load average before and after.
"""

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

from benchload import (
    FINAL,
    peak_overlap,
    percentiles,
    prepare,
    revoke,
    wait_final,
)
from benchprocs import start_web, start_worker, stop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/execgo_bench_mixed")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/12")
os.environ.setdefault("EXECGO_DATA_DIR", str(ROOT / "var" / "bench-mixed"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")
# Debug off, as deployed: the settings then want a key and host names.
os.environ.setdefault("DJANGO_SECRET_KEY", "execgo-bench-only-" + "0123456789abcdef" * 3)
os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
os.environ["EXECGO_LOG_LEVEL"] = "WARNING"

PLAN = {"steps": [{"id": "nap", "tool": "shell", "params": {"argv": ["sleep", "1"]}}]}
POLL_S = 0.1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0, help="how long runs are kept in flight")
    parser.add_argument("--inflight", type=int, default=50, help="runs in flight at all times")
    parser.add_argument("--concurrency", "-c", type=int, default=2, help="the worker's pool processes")
    parser.add_argument("--tail", type=float, default=120.0, help="seconds at most to wait for the runs left")
    parser.add_argument("--quick", action="store_true", help="a 15 s window (a smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.seconds = 15.0

    data_dir, tokens = prepare("bench-mixed", 1)
    import httpx

    from runs.models import Run, Step

    load_before = os.getloadavg()

    worker = start_worker(data_dir, args.concurrency)
    web, port = start_web(data_dir)
    sent_at: dict[int, float] = {}
    finished_at: dict[int, float] = {}
    answers: collections.Counter = collections.Counter()
    try:
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60,
                              headers={"Authorization": f"Token {tokens[0][1]}"})

        def submit(title: str) -> int | None:
            started = time.time()
            response = client.post("/api/v1/runs", json={"title": title, "plan": PLAN})
            answers[response.status_code] += 1
            if response.status_code != 201:
                return None
            run_id = response.json()["id"]
            sent_at[run_id] = started
            return run_id

        warm = submit("warm-up")  # the worker up and warm; not counted
        if warm is None:
            raise SystemExit(f"warm-up POST refused: {dict(answers)}")
        wait_final([warm], 120, poll_s=POLL_S)
        del sent_at[warm]
        answers.clear()

        start = time.time()
        end = start + args.seconds
        inflight = {run_id for run_id in (submit("mixed") for _ in range(args.inflight)) if run_id}
        while time.time() < end:
            time.sleep(POLL_S)
            for run_id, finished in Run.objects.filter(pk__in=inflight, state__in=FINAL).values_list(
                    "pk", "finished_at"):
                finished_at[run_id] = finished.timestamp()
                inflight.discard(run_id)
            while len(inflight) < args.inflight and time.time() < end:
                run_id = submit("mixed")
                if run_id is None:
                    time.sleep(POLL_S)  # refused (throttled, or the store busy): try again at the next look
                    break
                inflight.add(run_id)
        tail_s = wait_final(list(inflight), args.tail, poll_s=POLL_S)
        client.close()
    finally:
        stop(web, worker, wait_s=120)  # a backlog's tasks end first
        revoke(tokens)
    load_after = os.getloadavg()

    rows = list(Run.objects.filter(pk__in=list(sent_at)).values_list("pk", "state", "finished_at"))
    states = collections.Counter(state for _pk, state, _finished in rows)
    final = {pk: finished.timestamp() for pk, state, finished in rows if state in FINAL and finished}
    within = sum(1 for finished in final.values() if finished <= end)
    latencies = [(finished - sent_at[pk]) * 1000 for pk, finished in final.items()]
    points = percentiles(latencies, (50, 95))
    spans = [(started.timestamp(), finished.timestamp()) for started, finished in
             Step.objects.filter(run_id__in=list(sent_at), started_at__isnull=False, finished_at__isnull=False)
             .values_list("started_at", "finished_at")]
    durations = [(finished - started) * 1000 for started, finished in spans]

    print(f"{args.seconds:g} s window, {args.inflight} runs in flight, one `sleep 1` step a run, "
          f"worker -c {args.concurrency} ({os.environ['DATABASE_URL'].split(':')[0]} + "
          f"{os.environ['CELERY_BROKER_URL'].split(':')[0]})")
    print(f"  runs submitted: {len(sent_at)}; answers: {dict(sorted(answers.items()))}")
    print(f"  runs completed within the window: {within}, {within / args.seconds:.2f} runs/s")
    print(f"  runs final in all: {len(final)} of {len(sent_at)} ({tail_s:.1f} s after the window); "
          f"states: {dict(states)}")
    print(f"  POST -> final: p50 {points[50]:.0f} ms, p95 {points[95]:.0f} ms over {len(latencies)} runs")
    print(f"  steps running at once at peak: {peak_overlap(spans)} (of {len(spans)} steps; a step's own time "
          f"median {statistics.median(durations) if durations else float('nan'):.0f} ms)")
    print("  load average (1, 5, 15 min) before: " + ", ".join(f"{x:.2f}" for x in load_before)
          + "; after: " + ", ".join(f"{x:.2f}" for x in load_after))


if __name__ == "__main__":
    main()
