"""ExecGo next to Prefect 3 on the same sequential workloads: plans (flows)
of 1, 10 and 40 steps (tasks), each step running `true`, timed warm.

    .venv/bin/python bench/bench_vs_prefect.py [--steps 1 10 40] [--repeat 7] [--pause 2] [--quick]

Prefect is installed (pip, `prefect>=3,<4`) into a virtualenv of its own,
var/prefect-venv, made with `python3 -m venv` when missing; the project's
own environment gets nothing. Its data (PREFECT_HOME) is var/prefect-home;
it runs offline on its ephemeral local server (a temporary API server on
SQLite that the flow's process starts and stops itself), analytics off.

ExecGo, as bench_run_latency.py (whose client and wait it uses): PostgreSQL (its own database,
execgo_bench) and Redis db 13 unless DATABASE_URL / CELERY_BROKER_URL are
set, a real `-c 2` Celery worker, debug off; a sample is the wall time from
POST /api/v1/runs (in-process API client) to the run's finished_at, read by
polling its row. Prefect (bench/prefect_flows.py, run by the Prefect
virtualenv's python): a flow of N tasks called one after the other, each
running `true` through subprocess, in a process that has already run one
(its API server up, its imports done); a sample is the wall time of one
flow call, as its caller waits it. Prefect's defaults are kept: a flow call
returns only once its heartbeat thread, which sleeps in one-second slices,
has seen the flow end, so the call's time is the flow run's rounded up to
about the next whole second; the time from the call to the flow run's
end_time in Prefect's API (the figure closest to ExecGo's finished_at) is
printed too. On both sides one run warms up and is not counted, then each
repeat runs every workload in turn, each timed run after --pause seconds
idle: a sample is one run on a warm, quiet system, not the previous run's
aftermath (with no pause, Prefect's ephemeral server took 2 to 3 s for a
one-task flow right after a 40-task one here, against about 1.1 s after a
pause). The worker is stopped before Prefect runs: the two never share the
machine.

Prints every workload's samples, then a table: workload, ExecGo median,
Prefect median (the flow call), the ratio Prefect/ExecGo (above 1: ExecGo
faster), and the same for Prefect's end_time; then references for the
machine's speed before and after (bench_run_latency.py's). --quick:
--repeat 3, a smoke test.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

# ExecGo's side is bench_run_latency.py's: importing it sets the same
# environment (its database, Redis db, data directory, debug off).
from bench_run_latency import ROOT, agent_client, machine_reference, post_and_wait
from benchdb import ensure_database
from benchprocs import start_worker, stop

PREFECT_VENV = ROOT / "var" / "prefect-venv"
PREFECT_HOME = ROOT / "var" / "prefect-home"
PREFECT_REQUIREMENT = "prefect>=3,<4"


def ensure_prefect() -> Path:
    """The Prefect virtualenv's python, Prefect 3 installed in it."""
    python = PREFECT_VENV / "bin" / "python"
    if not python.exists():
        base = shutil.which("python3")
        if base is None:
            raise SystemExit("python3 not found: it makes the Prefect virtualenv")
        subprocess.run([base, "-m", "venv", str(PREFECT_VENV)], check=True)
    check = "import prefect, sys; sys.exit(0 if prefect.__version__.split('.')[0] == '3' else 1)"
    if subprocess.run([str(python), "-c", check], capture_output=True).returncode != 0:
        log = ROOT / "var" / "prefect-venv-install.log"
        print(f"installing {PREFECT_REQUIREMENT} into {PREFECT_VENV} (pip's output: {log})", flush=True)
        with open(log, "wb") as out:
            done = subprocess.run([str(python), "-m", "pip", "install", PREFECT_REQUIREMENT], stdout=out,
                                  stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise SystemExit(f"pip install {PREFECT_REQUIREMENT} failed:\n{log.read_text()[-3000:]}")
    return python


def prefect_version(python: Path) -> str:
    return subprocess.run([str(python), "-c", "import prefect; print(prefect.__version__)"], capture_output=True,
                          text=True, check=True).stdout.strip()


def prefect_samples(python: Path, steps: list[int], repeat: int, pause: float) -> dict[str, dict[int, list[float]]]:
    """bench/prefect_flows.py's samples (seconds), on Prefect's ephemeral
    server: "call" (the flow call's wall time) and "end" (to the flow run's end_time)."""
    PREFECT_HOME.mkdir(parents=True, exist_ok=True)
    env = {name: value for name, value in os.environ.items() if not name.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(PREFECT_HOME), PREFECT_SERVER_ALLOW_EPHEMERAL_MODE="true",
               PREFECT_SERVER_ANALYTICS_ENABLED="false")
    log = Path(os.environ["EXECGO_DATA_DIR"]) / "bench-prefect.log"
    with open(log, "wb") as err:
        done = subprocess.run([str(python), str(ROOT / "bench" / "prefect_flows.py"), "--steps", *map(str, steps),
                               "--repeat", str(repeat), "--pause", str(pause)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the Prefect flows failed:\n{log.read_text()[-3000:]}")
    samples = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return {kind: {int(count): values for count, values in by_count.items()} for kind, by_count in samples.items()}


def execgo_samples(steps: list[int], repeat: int, pause: float) -> dict[int, list[float]]:
    """Seconds from POST to the run's finished_at, for each plan size in turn."""
    from execgo.celery import app

    app.control.purge()
    client = agent_client()

    def one(count: int) -> float:
        plan = {"steps": [{"id": f"s{i}", "tool": "shell", "params": {"argv": ["true"]},
                           **({"depends_on": [f"s{i - 1}"]} if i else {})} for i in range(count)]}
        _run_id, started_at, finished_at = post_and_wait(client, plan)
        return finished_at - started_at

    worker = start_worker(Path(os.environ["EXECGO_DATA_DIR"]))
    try:
        one(steps[0])  # warms the worker up; not counted
        samples: dict[int, list[float]] = {count: [] for count in steps}
        for _ in range(repeat):
            for count in steps:
                time.sleep(pause)
                samples[count].append(one(count))
    finally:
        stop(worker)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 10, 40], help="the workloads' step counts")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--pause", type=float, default=2.0, help="seconds idle before each timed run, both sides")
    parser.add_argument("--quick", action="store_true", help="--repeat 3 (a smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.repeat = 3

    python = ensure_prefect()
    Path(os.environ["EXECGO_DATA_DIR"]).mkdir(parents=True, exist_ok=True)
    ensure_database(os.environ["DATABASE_URL"])
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    reference_before = machine_reference()
    execgo = execgo_samples(args.steps, args.repeat, args.pause)
    prefect = prefect_samples(python, args.steps, args.repeat, args.pause)
    reference_after = machine_reference()

    def ms(values: list[float]) -> str:
        return ", ".join(f"{value * 1000:.0f}" for value in values)

    stack = f"{os.environ['DATABASE_URL'].split(':')[0]} + {os.environ['CELERY_BROKER_URL'].split(':')[0]}"
    print(f"sequential `true` steps, warm, {args.repeat} samples each, {args.pause:g} s idle before each; "
          f"ExecGo: POST -> finished_at ({stack}, worker -c 2); "
          f"Prefect {prefect_version(python)}: one flow call (ephemeral local server)")
    for count in args.steps:
        print(f"  {count:>3} steps  ExecGo ms: {ms(execgo[count])}")
        print(f"  {count:>3} steps  Prefect ms, flow call: {ms(prefect['call'][count])}; "
              f"to the flow run's end_time: {ms(prefect['end'][count])}")
    print()
    print(f"{'workload':<12}{'ExecGo median':>15}{'Prefect median':>16}{'Prefect/ExecGo':>16}"
          f"{'Prefect end_time':>18}{'Prefect/ExecGo':>16}")
    for count in args.steps:
        ours = statistics.median(execgo[count])
        call, end = statistics.median(prefect["call"][count]), statistics.median(prefect["end"][count])
        print(f"{f'{count} step' + ('s' if count != 1 else ''):<12}{ours * 1000:>12.1f} ms{call * 1000:>13.1f} ms"
              f"{call / ours:>15.2f}x{end * 1000:>15.1f} ms{end / ours:>15.2f}x")
    print(f"machine reference before: {reference_before}; after: {reference_after}")


if __name__ == "__main__":
    main()
