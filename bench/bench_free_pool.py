"""Steps that wait do not hold the worker: how quickly a quick run gets
through while long steps run, and how quickly a burst of slow runs drains,
on one `-c 2` worker.

    .venv/bin/python bench/bench_free_pool.py [--repeat 7] [--burst 200] [--concurrency 2] [--pool-bound] [--only quick|burst]

Two parts, each on a fresh Celery worker and a Daphne web process (both
real, debug off, no beat), PostgreSQL (its own database,
execgo_bench_free_pool) and Redis db 12 unless DATABASE_URL /
CELERY_BROKER_URL are set:

1. Two runs of one `sleep 20` step are started and seen running; then
   --repeat runs of one `true` step are submitted one after another, each
   waited for: POST to SUCCEEDED per run (the run's finished_at less the
   moment its POST was sent). The two sleepers are cancelled afterwards.
2. --burst runs of one `sleep 1` step are submitted at once (from 8
   threads); the time from the first POST to the last run final, their
   states, and the most steps running at one instant.

--pool-bound runs both as a worker whose pool processes wait for every step
to its end (EXECGO_STEP_HAND_OFF_S=-1) and whose host has one slot per pool
process (EXECGO_TASK_SLOTS=--concurrency): how it was before steps were
handed to the watcher.
"""

import argparse
import collections
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchload import FINAL, peak_overlap, prepare, revoke, wait_final
from benchprocs import start_web, start_worker, stop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/execgo_bench_free_pool")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/12")
os.environ.setdefault("EXECGO_DATA_DIR", str(ROOT / "var" / "bench-free-pool"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")
# Debug off, as deployed: the settings then want a key and host names.
os.environ.setdefault("DJANGO_SECRET_KEY", "execgo-bench-only-" + "0123456789abcdef" * 3)
os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
os.environ["EXECGO_LOG_LEVEL"] = "WARNING"


def plan(*argv: str) -> dict:
    return {"steps": [{"id": "only", "tool": "shell", "params": {"argv": list(argv)}}]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=7, help="quick runs timed beside the two sleepers")
    parser.add_argument("--burst", type=int, default=200, help="`sleep 1` runs submitted at once")
    parser.add_argument("--concurrency", "-c", type=int, default=2, help="the worker's pool processes")
    parser.add_argument("--pool-bound", action="store_true", help="pool processes wait for their steps (before)")
    parser.add_argument("--only", choices=("quick", "burst"), help="run one of the two parts")
    args = parser.parse_args()
    if args.pool_bound:
        os.environ["EXECGO_STEP_HAND_OFF_S"] = "-1"
        os.environ["EXECGO_TASK_SLOTS"] = str(args.concurrency)
    else:
        os.environ.pop("EXECGO_TASK_SLOTS", None)  # the default: many slots per CPU

    data_dir, tokens = prepare("bench-free-pool", 1)
    import httpx

    from runs.models import Run, Step

    mode = "pool-bound (before)" if args.pool_bound else "steps handed to the watcher"
    print(f"worker -c {args.concurrency}, {mode}; {os.environ['DATABASE_URL'].split(':')[0]} + "
          f"{os.environ['CELERY_BROKER_URL'].split(':')[0]}")
    try:
        parts = {"quick": quick_beside_sleepers, "burst": burst}
        for name, part in parts.items():
            if args.only not in (None, name):
                continue
            worker = start_worker(data_dir, args.concurrency)
            web, port = start_web(data_dir)
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120,
                                  headers={"Authorization": f"Token {tokens[0][1]}"})
            try:
                warm = submit(client, plan("true"))[0]  # the worker up and warm
                wait_final([warm], 120, poll_s=0.05)
                part(client, args, Run, Step)
            finally:
                client.close()
                stop(web, worker, wait_s=60)
    finally:
        revoke(tokens)


def submit(client, body_plan: dict) -> tuple[int, float]:
    sent = time.time()
    response = client.post("/api/v1/runs", json={"title": "free-pool", "plan": body_plan})
    if response.status_code != 201:
        raise SystemExit(f"POST refused: {response.status_code} {response.text[:300]}")
    return response.json()["id"], sent


def quick_beside_sleepers(client, args, Run, Step) -> None:
    sleepers = [submit(client, plan("sleep", "20"))[0] for _ in range(2)]
    deadline = time.monotonic() + 30
    while Step.objects.filter(run_id__in=sleepers, run_status="running").count() < 2:
        if time.monotonic() > deadline:
            raise SystemExit("the two sleepers did not start within 30 s")
        time.sleep(0.05)
    time.sleep(0.5)  # past the hand-off, when there is one
    latencies = []
    for _ in range(args.repeat):
        run_id, sent = submit(client, plan("true"))
        wait_final([run_id], 60, poll_s=0.01)
        run = Run.objects.get(pk=run_id)
        latencies.append((run.finished_at.timestamp() - sent) * 1000 if run.state == "SUCCEEDED" else float("inf"))
    still = Step.objects.filter(run_id__in=sleepers, run_status="running").count()
    for run_id in sleepers:
        client.post(f"/api/v1/runs/{run_id}/cancel", json={"reason": "bench done"})
    wait_final(sleepers, 60, poll_s=0.1)
    print(f"  one `true` run beside two running `sleep 20` steps, {args.repeat} runs one after another: "
          f"POST -> SUCCEEDED median {statistics.median(latencies):.0f} ms, max {max(latencies):.0f} ms "
          f"(sleepers still running at the end: {still} of 2)")


def burst(client, args, Run, Step) -> None:
    started = time.time()
    with ThreadPoolExecutor(max_workers=8) as pool:
        run_ids = [run_id for run_id, _sent in pool.map(lambda _: submit(client, plan("sleep", "1")),
                                                        range(args.burst))]
    posted = time.time() - started
    wait_final(run_ids, 600, poll_s=0.1)
    rows = list(Run.objects.filter(pk__in=run_ids).values_list("state", "finished_at"))
    states = collections.Counter(state for state, _finished in rows)
    last = max((finished.timestamp() for state, finished in rows if state in FINAL and finished), default=started)
    spans = [(s.timestamp(), f.timestamp()) for s, f in Step.objects.filter(
        run_id__in=run_ids, started_at__isnull=False, finished_at__isnull=False).values_list("started_at",
                                                                                             "finished_at")]
    print(f"  {args.burst} runs of one `sleep 1` step submitted at once ({posted:.1f} s to POST them all): "
          f"all final {last - started:.1f} s after the first POST; states {dict(states)}; "
          f"steps running at once at peak: {peak_overlap(spans)}")


if __name__ == "__main__":
    main()
