"""Database queries a run costs, per stage and per step: a sequential plan
of `true` steps driven in this process, every query counted.

    .venv/bin/python bench/bench_queries.py [--steps 40] [--show N]

PostgreSQL (its own database, execgo_bench_queries) unless DATABASE_URL is
set. The run is submitted through the service the API calls, then driven
as a worker drives it: the stages and the first step in one call
(``run_advance``, what the advance task runs), then each step's result and
the next step's start, in a row (``execute_claims``). The step commands run
in their shims as on a worker; the messages sent meanwhile (the advance
task, the run's timer) are dropped from the broker at the end. Prints the queries of the
submit, of the stages up to the first step's start, per step in between
(the median of steps 2 … N-1) and of the last step with the close; with
``--show N``, the N commonest statements of a middle step.
"""

import argparse
import collections
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/execgo_bench_queries")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/12")
os.environ.setdefault("EXECGO_DATA_DIR", str(ROOT / "var" / "bench-queries"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", "execgo-bench-only-" + "0123456789abcdef" * 3)
os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
os.environ["CELERY_TASK_ALWAYS_EAGER"] = "false"  # messages go to the broker, and are dropped there
os.environ["EXECGO_LOG_LEVEL"] = "WARNING"

from benchload import prepare, purge_queues, revoke  # noqa: E402


class Counter:
    """Every query on every connection, with when it was sent."""

    def __init__(self):
        self.phase = "submit"
        self.queries: list[tuple[str, float, str]] = []

    def __call__(self, execute, sql, params, many, context):
        self.queries.append((self.phase, time.time(), sql))
        return execute(sql, params, many, context)


def shape(sql: str) -> str:
    """A statement with its literals and lists folded, to count by kind."""
    sql = re.sub(r"'[^']*'", "?", sql)
    sql = re.sub(r"\b\d+\b", "?", sql)
    sql = re.sub(r"\((?:\s*\?\s*,)+\s*\?\s*\)", "(…)", sql)
    return sql[:160]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--show", type=int, default=0, help="the commonest statements of a middle step")
    parser.add_argument("--phase", default="", help="show the statements of this phase instead (submit, stages, "
                        "s0 … s<N-1>)")
    args = parser.parse_args()

    _data_dir, tokens = prepare("bench-queries", 1)
    from django.db import connections

    from runs.execution import execute_claims
    from runs.models import Event, EventType, Run, Step
    from runs.pipeline import run_advance
    from runs.services import run_submit

    token = tokens[0][0]
    tenant = token.user.membership.tenant
    steps = [{"id": f"s{i}", "tool": "shell", "params": {"argv": ["true"]},
              **({"depends_on": [f"s{i - 1}"]} if i else {})} for i in range(args.steps)]
    counter = Counter()

    wrappers = [connections[alias].execute_wrapper(counter) for alias in connections]
    try:
        for wrapper in wrappers:
            wrapper.__enter__()
        for _ in range(2):  # a warm-up run, then the measured one
            counter.queries.clear()
            counter.phase = "submit"
            run_id = run_submit(tenant=tenant, user=token.user, plan={"steps": steps}).run.pk
            counter.phase = "stages"
            execute_claims(run_advance(run_id))
    finally:
        for wrapper in reversed(wrappers):
            wrapper.__exit__(None, None, None)
        revoke(tokens)
        purge_queues()  # the advance task the submit sent, the run's timer: this process did their work

    # A query belongs to the step that had started last when it was sent.
    starts = sorted((step.started_at.timestamp(), step.step_id) for step in Step.objects.filter(run_id=run_id))
    by_phase: dict[str, list[str]] = collections.defaultdict(list)
    for phase, at, sql in counter.queries:
        if phase == "stages":
            phase = next((step_id for started, step_id in reversed(starts) if started <= at), "stages")
        by_phase[phase].append(sql)
    run = Run.objects.get(pk=run_id)
    started = Event.objects.filter(run=run, type=EventType.TASK_STARTED).count()
    per_step = [len(by_phase[f"s{i}"]) for i in range(1, args.steps - 1)]
    print(f"one run of {args.steps} sequential `true` steps ({os.environ['DATABASE_URL'].split(':')[0]}): "
          f"{run.state}, {started} steps started")
    between = (f"median {statistics.median(per_step):.0f} (min {min(per_step)}, max {max(per_step)})" if per_step
               else "none here")
    print(f"  queries: submit {len(by_phase['submit'])}, stages to the first step's start "
          f"{len(by_phase['stages'])}, a step in between (result, next start) {between}, the last step and "
          f"the close {len(by_phase[f's{args.steps - 1}'])}; all "
          f"{sum(len(queries) for queries in by_phase.values())}")
    if args.show:
        phase = args.phase or f"s{args.steps // 2}"
        middle = by_phase[phase]
        print(f"  {phase}'s statements, commonest first:")
        for sql, count in collections.Counter(shape(sql) for sql in middle).most_common(args.show):
            print(f"    {count} × {sql}")


if __name__ == "__main__":
    main()
