"""The history checker: what must hold of a set of accepted runs once a
workload has run, whatever faults it met (crashes, kills, a broker or a
database lost mid-way). The fault tests call ``check_history`` with the ids
of every run the API accepted; an empty list means the history is sound.

- every accepted run is final, and it reached its final state exactly once
  (one ``run_state_changed`` event into a final state), from TRACING;
- a run that executed ended by its deadline plus ``grace_s`` (the deadline
  scan's interval and grace, the sweeper's);
- no step attempt started twice or ended twice, and no step was started
  again after an attempt of it succeeded; no step of a final run is left
  accepted or running;
- no step's side effect happened more often than the step was started
  (``side_effects``: what a loopback recorder counted for each step the
  workload gave one, tests/reliability/recorder.py), and a step that
  succeeded had its side effect;
- ``execgo_reconcile``'s invariants hold (one final audit event per final
  run, the jobs' projection, every audit chain unbroken);
- each tenant's audit export verifies offline (``tools/verify_audit.py``,
  the standard library only).
"""

import subprocess
import sys
from collections import Counter
from datetime import timedelta
from pathlib import Path

from django.core.management import call_command

from runs.invariants import find_violations
from runs.models import Event, EventType, Run, Step, StepRunStatus
from runs.statemachine import FINAL, RunState

ROOT = Path(__file__).resolve().parent.parent.parent
ENDED = (EventType.TASK_SUCCEEDED, EventType.TASK_FAILED, EventType.TASK_CANCELLED)


def check_history(run_ids: list[int], *, grace_s: float = 15.0, export_dir: Path | None = None,
                  side_effects: dict[tuple[int, str], int] | None = None) -> list[str]:
    """The violations found in the history of ``run_ids`` (empty: none).
    ``side_effects``: (run id, step id) → how many times the recorder saw
    that step's side effect, for every step of these runs that has one."""
    runs = Run.objects.in_bulk(run_ids)
    violations = [f"run {run_id} was accepted but does not exist" for run_id in run_ids if run_id not in runs]
    violations += _runs_ended_once(runs, grace_s)
    violations += _attempts_ran_once(list(runs))
    if side_effects is not None:
        violations += _effects_once_an_attempt(side_effects)
    violations += find_violations()
    if export_dir is not None:
        violations += _exports_verify({run.tenant_id for run in runs.values()}, export_dir)
    return violations


def _runs_ended_once(runs: dict[int, Run], grace_s: float) -> list[str]:
    violations = []
    into_final = Counter()
    came_from: dict[int, str] = {}
    for run_id, data in Event.objects.filter(run_id__in=list(runs), type=EventType.RUN_STATE_CHANGED).values_list(
            "run_id", "data"):
        if data.get("to") in FINAL:
            into_final[run_id] += 1
            came_from[run_id] = data.get("from")
    for run_id, run in sorted(runs.items()):
        if run.state not in FINAL:
            violations.append(f"run {run_id} is {run.state}, not final")
            continue
        if into_final[run_id] != 1:
            violations.append(f"run {run_id} entered a final state {into_final[run_id]} times")
        elif came_from[run_id] != RunState.TRACING:
            violations.append(f"run {run_id} became {run.state} from {came_from[run_id]}, not TRACING")
        if run.deadline is not None and run.finished_at > run.deadline + timedelta(seconds=grace_s):
            late = (run.finished_at - run.deadline).total_seconds()
            violations.append(f"run {run_id} ended {late:.1f} s after its deadline (grace {grace_s:g} s)")
    for run_id, step_id, status in Step.objects.filter(
            run_id__in=[run_id for run_id, run in runs.items() if run.state in FINAL],
            run_status__in=[StepRunStatus.ACCEPTED, StepRunStatus.RUNNING]).values_list("run_id", "step_id",
                                                                                        "run_status"):
        violations.append(f"run {run_id} is final but its step {step_id} is still {status}")
    return violations


def _attempts_ran_once(run_ids: list[int]) -> list[str]:
    violations = []
    started, ended = Counter(), Counter()
    succeeded_at: dict[tuple[int, str], int] = {}
    for run_id, step_id, kind, data in Event.objects.filter(
            run_id__in=run_ids, type__in=[EventType.TASK_STARTED, *ENDED]).values_list("run_id", "task_id", "type",
                                                                                         "data"):
        attempt = (run_id, step_id, data.get("attempt"))
        if kind == EventType.TASK_STARTED:
            started[attempt] += 1
        else:
            ended[attempt] += 1
            if kind == EventType.TASK_SUCCEEDED:
                succeeded_at[run_id, step_id] = data.get("attempt") or 0
    for (run_id, step_id, attempt), count in sorted(started.items(), key=str):
        if count > 1:
            violations.append(f"run {run_id} step {step_id} attempt {attempt} started {count} times")
        if (run_id, step_id) in succeeded_at and (attempt or 0) > succeeded_at[run_id, step_id]:
            violations.append(f"run {run_id} step {step_id} started attempt {attempt} after attempt "
                              f"{succeeded_at[run_id, step_id]} succeeded")
    for (run_id, step_id, attempt), count in sorted(ended.items(), key=str):
        if count > 1:
            violations.append(f"run {run_id} step {step_id} attempt {attempt} ended {count} times")
    return violations


def _effects_once_an_attempt(side_effects: dict[tuple[int, str], int]) -> list[str]:
    started, succeeded = Counter(), set()
    for run_id, step_id, kind in Event.objects.filter(
            run_id__in={run_id for run_id, _step in side_effects},
            type__in=[EventType.TASK_STARTED, EventType.TASK_SUCCEEDED]).values_list("run_id", "task_id", "type"):
        if kind == EventType.TASK_STARTED:
            started[run_id, step_id] += 1
        else:
            succeeded.add((run_id, step_id))
    violations = []
    for (run_id, step_id), count in sorted(side_effects.items()):
        if count > started[run_id, step_id]:
            violations.append(f"run {run_id} step {step_id}: its side effect happened {count} times in "
                              f"{started[run_id, step_id]} started attempts")
        if (run_id, step_id) in succeeded and count == 0:
            violations.append(f"run {run_id} step {step_id} succeeded but its side effect never happened")
    return violations


def _exports_verify(tenant_ids: set[int], export_dir: Path) -> list[str]:
    violations = []
    for tenant_id in sorted(tenant_ids):
        export = export_dir / f"audit-{tenant_id}.jsonl"
        call_command("execgo_audit_export", tenant=str(tenant_id), output=str(export))
        checked = subprocess.run([sys.executable, "-I", "-S", str(ROOT / "tools" / "verify_audit.py"), str(export)],
                                 capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
        if checked.returncode != 0:
            violations.append(f"the audit export of tenant {tenant_id} does not verify: {checked.stdout.strip()}")
    return violations
