"""Prefect's side of bench_vs_prefect.py, run only by the Prefect virtualenv's
python (var/prefect-venv), never by the project's: a flow of N sequential
tasks, each running `true` in a subprocess, timed warm in one process.

    var/prefect-venv/bin/python bench/prefect_flows.py --steps 1 10 40 --repeat 7 [--pause 2]

One flow run (of the first workload) warms up first and is not counted; then
every workload runs --repeat times in turn, each flow call after --pause
seconds idle. Prints one JSON object on its last line:
{"call": {"<steps>": [seconds, ...], ...}, "end": {...}}: for each flow
run, from the call to its return (the flow run and its task runs then final
in Prefect's API), and from the call to the flow run's end_time as Prefect's
API has it (read after the call, out of the time measured).
"""

import argparse
import json
import subprocess
import time

from prefect import flow, get_client, task


@task
def true_step(index: int) -> int:
    subprocess.run(["true"], check=True)
    return index


@flow
def sequential(steps: int) -> int:
    done = 0
    for index in range(steps):
        done = true_step(index)  # called, not submitted: each task ends before the next starts
    return done


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 10, 40])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--pause", type=float, default=0.0, help="seconds idle before each flow call timed")
    args = parser.parse_args()

    sequential(args.steps[0])  # warm-up: the API's first requests, imports, the task's first run
    call: dict[str, list[float]] = {str(steps): [] for steps in args.steps}
    end: dict[str, list[float]] = {str(steps): [] for steps in args.steps}
    with get_client(sync_client=True) as client:
        for _ in range(args.repeat):
            for steps in args.steps:
                time.sleep(args.pause)
                started_at, started = time.time(), time.perf_counter()
                state = sequential(steps, return_state=True)
                call[str(steps)].append(time.perf_counter() - started)
                if not state.is_completed():
                    raise SystemExit(f"flow run ended {state.name}")
                flow_run = client.read_flow_run(state.state_details.flow_run_id)
                end[str(steps)].append(flow_run.end_time.timestamp() - started_at)
    print(json.dumps({"call": call, "end": end}))


if __name__ == "__main__":
    main()
