"""What /metrics counts in the processes (prometheus_client, multiprocess
mode); the exposition is ``runs.metrics_view``.

Each process, web or worker or pool child, writes its own files under
``EXECGO_METRICS_DIR`` (set as ``PROMETHEUS_MULTIPROC_DIR`` by the
settings, before anything imports the client); a scrape sums them. These
are what leaves no row worth counting at every scrape: transitions by edge,
step durations and errors, approval decision latency, events relayed.
Counts of a transaction are taken after it commits, so a rolled-back
transition or result is never counted.
"""

from django.db import transaction
from prometheus_client import Counter, Histogram

from runs.errors import ErrorCode

# --- Counted in the process (multiprocess files) -----------------------------

TRANSITIONS = Counter("execgo_transitions", "Run state transitions committed, by edge (from_state is empty "
                      "for a run's creation).", ["from_state", "to_state"])
STEP_DURATION = Histogram(
    "execgo_step_duration_seconds", "Duration of finished step attempts, by tool and run status.",
    ["tool", "status"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 600, float("inf")),
)
ERRORS = Counter("execgo_errors", "Step attempts that ended with an error, by error code and source.",
                 ["code", "source"])
APPROVAL_DECISION = Histogram(
    "execgo_approval_decision_seconds", "Time from an approval request to its decision, by outcome.",
    ["outcome"], buckets=(1, 5, 15, 30, 60, 300, 900, 1800, 3600, 4 * 3600, 24 * 3600, float("inf")),
)
EVENTS_RELAYED = Counter("execgo_events_relayed", "Outbox events a web process relayed to its live pages.")

KNOWN_CODES = frozenset(ErrorCode)
KNOWN_STATUSES = frozenset({"success", "failed", "cancelled"})
KNOWN_SOURCES = frozenset({"scheduler", "executor", "policy", "store", "api", "approval"})


def count_transition(source: str | None, target: str) -> None:
    """A transition of the caller's transaction, counted once it commits."""
    transaction.on_commit(lambda: TRANSITIONS.labels(source or "", target).inc())


def count_step_end(tool: str, result: dict) -> None:
    """An attempt's result applied in the caller's transaction, counted once it commits."""

    def count() -> None:
        # Label values come from closed sets: a result is data from a shim.
        status = result["status"] if result["status"] in KNOWN_STATUSES else "unknown"
        STEP_DURATION.labels(tool, status).observe(max(result.get("duration_ms") or 0, 0) / 1000)
        error = result.get("error")
        if error:
            code = error.get("code") if error.get("code") in KNOWN_CODES else "unknown"
            source = error.get("source") if error.get("source") in KNOWN_SOURCES else "unknown"
            ERRORS.labels(code, source).inc()

    transaction.on_commit(count)


def count_approval_decision(request) -> None:
    """A committed human decision that settled its request (an ApprovalRequest)."""
    if request.status in ("approved", "rejected") and request.decided_at:
        APPROVAL_DECISION.labels(request.status).observe(
            max((request.decided_at - request.requested_at).total_seconds(), 0))
