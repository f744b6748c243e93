"""The reconciliation invariants of SPEC §2.2, checked against the rows.

- count(SUCCEEDED runs) == count(AuditLog ``run_succeeded``);
- every final run has exactly one final AuditLog event, the one matching
  its state, and passed TRACING (its final transition came from TRACING);
- every Job's status is the projection of its latest run's state.
"""

from collections import Counter, defaultdict

from runs.models import FINAL_AUDIT_EVENT, AuditEvent, AuditLog, Job, Run, Trace, TraceKind
from runs.statemachine import FINAL, RunState, job_status_for


def find_violations() -> list[str]:
    violations: list[str] = []

    succeeded_runs = Run.objects.filter(state=RunState.SUCCEEDED).count()
    succeeded_audits = AuditLog.objects.filter(event=AuditEvent.RUN_SUCCEEDED).count()
    if succeeded_runs != succeeded_audits:
        violations.append(
            f"{succeeded_runs} SUCCEEDED runs but {succeeded_audits} run_succeeded audit events"
        )

    final_events = defaultdict(Counter)
    for run_id, event in AuditLog.objects.filter(event__in=FINAL_AUDIT_EVENT.values()).values_list("run_id", "event"):
        final_events[run_id][event] += 1
    entered_final_from = dict(
        Trace.objects.filter(kind=TraceKind.TRANSITION, to_state__in=FINAL).values_list("run_id", "from_state")
    )
    final_runs = dict(Run.objects.filter(state__in=FINAL).values_list("pk", "state"))

    for run_id, state in sorted(final_runs.items()):
        events = final_events.get(run_id, Counter())
        expected = FINAL_AUDIT_EVENT[state]
        if sum(events.values()) != 1 or events[expected] != 1:
            violations.append(f"run {run_id} is {state} but has final audit events {dict(events) or 'none'}")
        source = entered_final_from.get(run_id)
        if source != RunState.TRACING:
            violations.append(f"run {run_id} is {state} but did not pass TRACING (entered from {source or 'nowhere'})")

    for run_id in sorted(set(final_events) - set(final_runs)):
        violations.append(f"run {run_id} has final audit events {dict(final_events[run_id])} but is not final")

    for job_id, status, latest_state in Job.objects.filter(latest_run__isnull=False).values_list(
        "pk", "status", "latest_run__state"
    ):
        if status != job_status_for(latest_state):
            violations.append(f"job {job_id} reads {status!r} but its latest run is {latest_state}")
    return violations
