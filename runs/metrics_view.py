"""/metrics: Prometheus exposition through prometheus_client, one view of
every process of the host.

Two sources feed one registry per scrape:

- What the database holds, read at scrape time by ``DatabaseCollector``:
  runs by state, final runs by closing cause, pending approvals, every
  host's ledger, and the counts the AuditLog already keeps (zombies
  detected and recovered, invalid and lost transitions, stale results).
  Every web process reports the same figures whichever process did the work.
- What the processes counted (``runs.metrics``): each process, web or
  worker or pool child, writes its own files under ``EXECGO_METRICS_DIR``
  and a scrape sums them.

No gauge is kept in files (gauges come from the database), so a dead
process has nothing to withdraw; its counters and histograms must still be
summed, and are folded into one archive file per type so that the directory
does not grow with every process that ever ran.

Only a scraper with ``EXECGO_METRICS_TOKEN`` reads it (or anyone, where no
token is set and ``EXECGO_METRICS_PUBLIC`` opens it on purpose): the
figures name worker hosts and show how busy the service is. A refusal is
401 before anything is read, its body the same whatever the reason.
"""

import fcntl
import glob
import os
from collections import Counter as Tally
from pathlib import Path

from django.conf import settings
from django.db.models import Count
from django.http import HttpResponse
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector

from approvals.models import ApprovalRequest, ApprovalStatus
from runs.models import AuditEvent, AuditLog, Run, Step
from runs.operators import metrics_allowed, refused
from runs.statemachine import FINAL, FINAL_STATE_FOR_CAUSE, RunState
from runtime.models import HostCapacity

# --- Read from the database at scrape time -------------------------------------

AUDIT_COUNTERS = {
    AuditEvent.ZOMBIE_DETECTED: ("execgo_zombie_detected", "Stuck runs the zombie sweeper found."),
    AuditEvent.ZOMBIE_RECOVERED: ("execgo_zombie_recovered", "Stuck runs the zombie sweeper closed."),
    AuditEvent.INVALID_TRANSITION: ("execgo_invalid_transition", "Attempts at a transition outside the table."),
    AuditEvent.TRANSITION_LOST: ("execgo_transition_lost", "Transitions that lost the optimistic lock to "
                                                           "another writer."),
    AuditEvent.STALE_RESULT_IGNORED: ("execgo_stale_result_ignored", "Step results that arrived after their "
                                                                     "attempt was fenced."),
}
LEDGER_RESOURCES = ("task_slots", "memory_bytes", "pids")


class DatabaseCollector:
    """The state of things, read from the database at each scrape."""

    def collect(self):
        runs = GaugeMetricFamily("execgo_runs", "Runs by current state.", labels=["state"])
        closed = CounterMetricFamily("execgo_runs_closed", "Runs that reached a final state, by closing cause.",
                                     labels=["closing_cause"])
        by_state, by_cause = Tally(), Tally({cause: 0 for cause in FINAL_STATE_FOR_CAUSE})
        for state, cause, n in Run.objects.values_list("state", "closing_cause").annotate(n=Count("id")).order_by():
            by_state[state] += n
            if state in FINAL:
                by_cause[cause] += n
        for state in RunState.values:
            runs.add_metric([state], by_state[state])
        for cause, n in sorted(by_cause.items()):
            closed.add_metric([cause], n)
        yield runs
        yield closed

        steps = GaugeMetricFamily("execgo_steps", "Steps by scheduling status.", labels=["status"])
        for status, n in sorted(Step.objects.values_list("status").annotate(n=Count("id")).order_by()):
            steps.add_metric([status], n)
        yield steps

        audit_counts = dict(AuditLog.objects.filter(event__in=list(AUDIT_COUNTERS)).values_list("event")
                            .annotate(n=Count("id")).order_by())
        for event, (name, documentation) in AUDIT_COUNTERS.items():
            family = CounterMetricFamily(name, documentation)
            family.add_metric([], audit_counts.get(event, 0))
            yield family

        pending = GaugeMetricFamily("execgo_approvals_pending", "Approval requests waiting for a decision.")
        pending.add_metric([], ApprovalRequest.objects.filter(status=ApprovalStatus.PENDING).count())
        yield pending

        capacity = GaugeMetricFamily("execgo_ledger_capacity", "Resource ledger capacity per worker host.",
                                     labels=["host", "resource"])
        reserved = GaugeMetricFamily("execgo_ledger_reserved", "Resource ledger reservations per worker host.",
                                     labels=["host", "resource"])
        for row in HostCapacity.objects.order_by("host"):
            for resource in LEDGER_RESOURCES:
                capacity.add_metric([row.host, resource], getattr(row, f"{resource}_capacity"))
                reserved.add_metric([row.host, resource], getattr(row, f"{resource}_reserved"))
        yield capacity
        yield reserved


# --- The processes' files --------------------------------------------------------

ARCHIVED_TYPES = ("counter", "histogram", "summary")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def fold_dead_processes(directory: Path) -> int:
    """Fold the counter and histogram files of processes that are gone into
    ``<type>_archive.db``, adding their values, and delete them; return how
    many were folded. The caller holds the directory's lock exclusively, so
    no scrape sees a value twice or not at all."""
    folded = 0
    for typ in ARCHIVED_TYPES:
        archive = None
        for path in glob.glob(str(directory / f"{typ}_*.db")):
            pid = Path(path).stem.rsplit("_", 1)[-1]
            if not pid.isdigit() or _alive(int(pid)):
                continue
            archive = archive or MmapedDict(str(directory / f"{typ}_archive.db"))
            for key, value, timestamp, _pos in MmapedDict.read_all_values_from_file(path):
                archive.write_value(key, archive.read_value(key)[0] + value, timestamp)
            os.unlink(path)
            folded += 1
        if archive is not None:
            archive.close()
    return folded


def exposition() -> bytes:
    directory = Path(settings.EXECGO_METRICS_DIR)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    registry.register(DatabaseCollector())
    with open(directory / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # against another scrape folding files meanwhile
        fold_dead_processes(directory)
        return generate_latest(registry)


def metrics_view(request):
    if not metrics_allowed(request):
        return refused()
    return HttpResponse(exposition(), content_type=CONTENT_TYPE_PLAIN_0_0_4)
