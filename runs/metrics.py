"""/metrics: Prometheus text exposition, computed from the database so every
web process reports the same figures whichever worker did the work."""

from django.db.models import Count
from django.http import HttpResponse

from runs.models import AuditEvent, AuditLog, Run, Step
from runs.statemachine import RunState


def _line(name: str, value, **labels) -> str:
    rendered = ",".join(f'{key}="{val}"' for key, val in labels.items())
    return f"{name}{{{rendered}}} {value}" if rendered else f"{name} {value}"


COUNTED_AUDIT_EVENTS = (AuditEvent.ZOMBIE_RECOVERED, AuditEvent.STALE_RESULT_IGNORED, AuditEvent.INVALID_TRANSITION,
                        AuditEvent.TRANSITION_LOST)


def metrics_view(request):
    runs_by_state = dict(Run.objects.values_list("state").annotate(n=Count("id")).values_list("state", "n"))
    steps_by_status = dict(Step.objects.values_list("status").annotate(n=Count("id")).values_list("status", "n"))
    audit_counts = dict(
        AuditLog.objects.filter(event__in=COUNTED_AUDIT_EVENTS)
        .values_list("event").annotate(n=Count("id")).values_list("event", "n")
    )
    lines = ["# HELP execgo_runs Runs by state.", "# TYPE execgo_runs gauge"]
    lines += [_line("execgo_runs", runs_by_state.get(state, 0), state=state) for state in RunState.values]
    lines += ["# HELP execgo_steps Steps by scheduling status.", "# TYPE execgo_steps gauge"]
    lines += [_line("execgo_steps", count, status=status) for status, count in sorted(steps_by_status.items())]
    for event in COUNTED_AUDIT_EVENTS:
        name = f"execgo_{event}_total"
        lines += [f"# TYPE {name} counter", _line(name, audit_counts.get(event, 0))]
    return HttpResponse("\n".join(lines) + "\n", content_type="text/plain; version=0.0.4; charset=utf-8")
