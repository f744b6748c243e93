"""Sustained throughput of one-step runs (a `true` shell step) submitted over
HTTP, for a fixed time: what a deployment of one web process and one worker
keeps up with, and the time from POST to the run's end while it does.

    .venv/bin/python bench/bench_throughput.py [--seconds 60] [--tenants 1|4] [--submitters 8]
        [--rate RUNS_PER_S] [--concurrency 2] [--tail 120] [--quick]

A Daphne web process and a Celery worker (`-c 2` unless --concurrency),
both real, on PostgreSQL (its own database, execgo_bench_throughput) and
Redis db 12, unless DATABASE_URL / CELERY_BROKER_URL are set; debug off; no
beat (as bench_run_latency.py: its sweeper would send the work of runs
queued for long again, in the middle of the measure). Each of --tenants
tenants has an agent of its own (a user of the "agents" group with a new API
token); the submitters take the agents in turn. The API's throttle is the
deployed one (1200 requests a minute per agent and web process): a submitter
answered 429 waits as told (Retry-After), and the 429s are counted.

Open loop: the submitters never wait for a run to end. With --rate they
send at that rate (the k-th POST due k/rate seconds after the start, sent
late when every submitter is busy), without it each sends its next POST as
soon as the last one is answered: more than the worker keeps up with, so
the queue grows all along the window and POST to final with it (--rate
below the sustained rate measures the latency of a system keeping up).
After the window no more are sent and the runs still going are waited for,
--tail seconds at most (runs not final then are reported as such and left
as they are; the next invocation drops their queued messages). --quick: a
10 s window and a 60 s tail, a smoke test.

Prints the runs submitted (and the answers, by status), the runs
final and their states, the sustained rate (runs that became final within
the window, a second; and over the whole, from the window's start to the
last run's end), and the 50th, 95th and 99th percentiles of POST to final
(the run's finished_at less the moment its POST was sent), the machine's
CPU a final run cost, by who spent it (the web process, the worker, the
fork server, PostgreSQL, Redis, the kernel's threads, the shims and their
sandboxes: from the window's start until the last run ended, ``benchcpu``)
and the rate the machine's cores allow at that cost, with the load average
before and after (the machine's speed varies; compare with it).
"""

import argparse
import collections
import os
import sys
import threading
import time
from pathlib import Path

from benchcpu import CpuSample, cpu_line
from benchload import FINAL, percentiles, prepare, revoke, wait_final
from benchprocs import start_web, start_worker, stop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/execgo_bench_throughput")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/12")
os.environ.setdefault("EXECGO_DATA_DIR", str(ROOT / "var" / "bench-throughput"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")
# Debug off, as deployed: the settings then want a key and host names.
os.environ.setdefault("DJANGO_SECRET_KEY", "execgo-bench-only-" + "0123456789abcdef" * 3)
os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
os.environ["EXECGO_LOG_LEVEL"] = "WARNING"

PLAN = {"steps": [{"id": "t", "tool": "shell", "params": {"argv": ["true"]}}]}


class Submissions:
    """Every POST sent: when (epoch seconds), its answer's status and the run's id."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: list[tuple[float, int, int | None]] = []
        self.next_slot = 0
        self.late = 0  # POSTs of --rate sent more than 100 ms after they were due

    def add(self, sent_at: float, status: int, run_id: int | None) -> None:
        with self.lock:
            self.sent.append((sent_at, status, run_id))

    def take_slot(self) -> int:
        with self.lock:
            self.next_slot += 1
            return self.next_slot - 1


def submitter(base_url: str, key: str, log: Submissions, start: float, end: float, rate: float | None) -> None:
    import httpx

    with httpx.Client(base_url=base_url, timeout=60, headers={"Authorization": f"Token {key}"}) as client:
        while True:
            if rate:
                due = start + log.take_slot() / rate
                if due >= end:
                    return
                pause = due - time.time()
                if pause > 0:
                    time.sleep(pause)
                elif pause < -0.1:
                    with log.lock:
                        log.late += 1
            elif time.time() >= end:
                return
            sent_at = time.time()
            try:
                response = client.post("/api/v1/runs", json={"title": "throughput", "plan": PLAN})
            except httpx.HTTPError:
                log.add(sent_at, 0, None)
                continue
            log.add(sent_at, response.status_code, response.json()["id"] if response.status_code == 201 else None)
            if response.status_code == 429 and not rate:  # a well-behaved client waits as told
                time.sleep(min(float(response.headers.get("Retry-After", "1")), 5.0))


def warm_up(base_url: str, keys: list[str]) -> None:
    """One run per agent, each waited for: the worker is up and warm, every token works."""
    import httpx

    for key in keys:
        response = httpx.post(f"{base_url}/api/v1/runs", json={"title": "warm-up", "plan": PLAN},
                              headers={"Authorization": f"Token {key}"}, timeout=60)
        if response.status_code != 201:
            raise SystemExit(f"warm-up POST answered {response.status_code}: {response.text[:500]}")
        run_id = response.json()["id"]
        wait_final([run_id], 120, poll_s=0.1)
        from runs.models import Run

        state = Run.objects.filter(pk=run_id).values_list("state", flat=True).get()
        if state != "SUCCEEDED":
            raise SystemExit(f"warm-up run {run_id} ended {state}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0, help="how long runs are submitted")
    parser.add_argument("--tenants", type=int, default=1, help="tenants, each with an agent and token of its own")
    parser.add_argument("--submitters", type=int, default=8, help="concurrent submitters (threads)")
    parser.add_argument("--rate", type=float, default=None,
                        help="target POSTs a second over all submitters (default: as fast as they are answered)")
    parser.add_argument("--concurrency", "-c", type=int, default=2, help="the worker's pool processes")
    parser.add_argument("--tail", type=float, default=120.0, help="seconds at most to wait for the runs left")
    parser.add_argument("--quick", action="store_true", help="a 10 s window and a 60 s tail (a smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.tail = 10.0, min(args.tail, 60.0)

    data_dir, tokens = prepare("bench-throughput", args.tenants)
    from runs.models import Run

    keys = [key for _token, key in tokens]
    load_before = os.getloadavg()

    worker = start_worker(data_dir, args.concurrency)
    web, port = start_web(data_dir)
    base_url = f"http://127.0.0.1:{port}"
    log = Submissions()
    try:
        warm_up(base_url, keys)
        cpu_before = CpuSample()
        start = time.time()
        end = start + args.seconds
        threads = [threading.Thread(target=submitter, args=(base_url, keys[index % len(keys)], log, start, end,
                                                            args.rate), daemon=True)
                   for index in range(args.submitters)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        submitted_for = time.time() - start
        accepted = [run_id for _sent, status, run_id in log.sent if status == 201]
        tail_s = wait_final(accepted, args.tail)
        cpu_after = CpuSample()
    finally:
        stop(web, worker, wait_s=120)  # a backlog's tasks end first
        revoke(tokens)
    load_after = os.getloadavg()

    sent_at = {run_id: sent for sent, status, run_id in log.sent if status == 201}
    rows = list(Run.objects.filter(pk__in=accepted).values_list("pk", "state", "finished_at"))
    states = collections.Counter(state for _pk, state, _finished in rows)
    final = [(pk, finished.timestamp()) for pk, state, finished in rows if state in FINAL and finished]
    within = sum(1 for _pk, finished in final if finished <= end)
    latencies = [(finished - sent_at[pk]) * 1000 for pk, finished in final]
    answers = collections.Counter(status for _sent, status, _run in log.sent)
    points = percentiles(latencies, (50, 95, 99))

    target = f"target {args.rate:g} POSTs/s" if args.rate else "as fast as answered"
    print(f"{args.seconds:g} s window, {args.tenants} tenant(s), {args.submitters} submitters ({target}), "
          f"worker -c {args.concurrency}, one `true` step a run "
          f"({os.environ['DATABASE_URL'].split(':')[0]} + {os.environ['CELERY_BROKER_URL'].split(':')[0]})")
    print(f"  runs submitted: {len(accepted)} ({len(accepted) / submitted_for:.1f}/s); answers: "
          + ", ".join(f"{status or 'no answer'}: {count}" for status, count in sorted(answers.items()))
          + (f"; sent more than 100 ms late: {log.late}" if args.rate else ""))
    print(f"  runs final: {len(final)} of {len(accepted)} ({tail_s:.1f} s after the window); states: {dict(states)}")
    last = max((finished for _pk, finished in final), default=end)
    print(f"  sustained: {within / args.seconds:.2f} runs/s final within the window ({within} runs); "
          f"overall {len(final) / (last - start):.2f} runs/s ({len(final)} runs final {last - start:.1f} s "
          f"after the window's start)")
    print(f"  POST -> final: p50 {points[50]:.0f} ms, p95 {points[95]:.0f} ms, p99 {points[99]:.0f} ms "
          f"over {len(latencies)} runs")
    print("  " + cpu_line(cpu_after.since(cpu_before), len(final), "run", cpu_after.at - cpu_before.at))
    print("  load average (1, 5, 15 min) before: " + ", ".join(f"{x:.2f}" for x in load_before)
          + "; after: " + ", ".join(f"{x:.2f}" for x in load_after))


if __name__ == "__main__":
    main()
