"""Tenant-scoped reads. Every API and page read of runs goes through here."""

from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlencode

from django.db.models import Count, F, Q, QuerySet
from django.utils import timezone

from runs.models import AuditEvent, AuditLog, Event, EventType, Job, MemoryEntry, Run, Step, Tenant, Trace, TraceKind
from runs.statemachine import FINAL, TRANSIENT, RunState
from runtime.models import HostCapacity

LIVE_EVENT_FIELDS = ("id", "type", "run_id", "task_id", "handle_id", "timestamp", "message", "data")


def tenant_of(user) -> Tenant | None:
    membership = getattr(user, "membership", None) if getattr(user, "is_authenticated", False) else None
    return membership.tenant if membership is not None else None


def runs_for_user(user) -> QuerySet[Run]:
    tenant = tenant_of(user)
    if tenant is None:
        return Run.objects.none()
    return Run.objects.filter(tenant=tenant)


def jobs_for_user(user) -> QuerySet[Job]:
    tenant = tenant_of(user)
    if tenant is None:
        return Job.objects.none()
    return Job.objects.filter(tenant=tenant)


def run_events_after(run: Run, after: int, limit: int = 500) -> list[Event]:
    return list(Event.objects.filter(run=run, pk__gt=after).order_by("pk")[:limit])


def memories_for_user(user) -> QuerySet[MemoryEntry]:
    """The requesting agent's own memories in its tenant."""
    tenant = tenant_of(user)
    if tenant is None:
        return MemoryEntry.objects.none()
    return MemoryEntry.objects.filter(tenant=tenant, agent=user)


def run_in_tenant(run_id: int, tenant_id: int) -> bool:
    return Run.objects.filter(pk=run_id, tenant_id=tenant_id).exists()


def events_for_live_scope(scope: str, *, tenant_id: int, run_id: int | None, after: int, upto: int,
                          limit: int) -> list[dict]:
    """What a live page missed: the events in (after, upto] it subscribes to
    (see ``runs.relay.groups_for``), oldest first."""
    events = Event.objects.filter(pk__gt=after, pk__lte=upto)
    if scope == "run":
        events = events.filter(run_id=run_id, run__tenant_id=tenant_id)
    else:
        events = events.filter(run__tenant_id=tenant_id, type=EventType.RUN_STATE_CHANGED)
        if scope == "approvals":
            events = events.filter(Q(data__from=RunState.AWAITING_HITL) | Q(data__to=RunState.AWAITING_HITL))
    return list(events.order_by("pk").values(*LIVE_EVENT_FIELDS, "run__tenant_id")[:limit])


def latest_event_id() -> int:
    """The outbox's newest id: a page rendered after reading it replays
    every later event live, so it misses none."""
    return Event.objects.order_by("-pk").values_list("pk", flat=True).first() or 0


SINCE_CHOICES = {"1h": timedelta(hours=1), "24h": timedelta(days=1), "7d": timedelta(days=7)}


@dataclass(frozen=True)
class RunFilters:
    """The runs list's filters, as they stand in its URL."""

    state: str = ""
    agent: int | None = None
    since: str = ""
    q: str = ""

    @classmethod
    def from_query(cls, query) -> "RunFilters":
        state = query.get("state", "")
        since = query.get("since", "")
        raw_agent = query.get("agent", "")
        agent = int(raw_agent) if _is_id(raw_agent) else None
        return cls(state=state if state in RunState.values else "", agent=agent,
                   since=since if since in SINCE_CHOICES else "", q=query.get("q", "").strip()[:200])

    def query_string(self) -> str:
        return urlencode({key: value for key, value in (("state", self.state), ("agent", self.agent or ""),
                                                        ("since", self.since), ("q", self.q)) if value})


def runs_matching(user, filters: RunFilters) -> QuerySet[Run]:
    runs = runs_for_user(user).select_related("submitted_by").defer(*Run.BULKY_FIELDS).order_by("-id")
    if filters.state:
        runs = runs.filter(state=filters.state)
    if filters.agent:
        runs = runs.filter(submitted_by_id=filters.agent)
    if filters.since:
        runs = runs.filter(created_at__gte=timezone.now() - SINCE_CHOICES[filters.since])
    if filters.q:
        by_title = Q(title__icontains=filters.q)
        runs = runs.filter(by_title | Q(pk=int(filters.q))) if _is_id(filters.q) else runs.filter(by_title)
    return runs


def _is_id(text: str) -> bool:
    """A row id the databases can hold (``isdigit`` alone also takes "²")."""
    return text.isascii() and text.isdigit() and int(text) < 2**63


def submitters_of(user) -> list[tuple[int, str]]:
    """The users who submitted runs in the user's tenant (the agent filter)."""
    return list(runs_for_user(user).exclude(submitted_by=None).order_by("submitted_by__username")
                .values_list("submitted_by_id", "submitted_by__username").distinct())


@dataclass
class RunDetail:
    run: Run
    steps: list[Step]
    transitions: list[Trace]
    policy_decisions: list[Trace]
    hitl_decisions: list[Trace]
    other_traces: list[Trace]
    audit: list[AuditLog]


def run_detail_for(user, run_id: int) -> RunDetail | None:
    run = runs_for_user(user).select_related("job", "submitted_by", "retry_of", "cancel_requested_by").filter(
        pk=run_id).first()
    if run is None:
        return None
    traces = list(run.traces.select_related("step").order_by("id"))
    for trace in traces:
        trace.stage = _stage_of(trace.to_state)
    steps = list(run.steps.order_by("position"))
    return RunDetail(
        run=run,
        steps=steps,
        transitions=[t for t in traces if t.kind == TraceKind.TRANSITION],
        policy_decisions=[t for t in traces if t.kind == TraceKind.POLICY_DECISION],
        hitl_decisions=[t for t in traces if t.kind == TraceKind.HITL_DECISION],
        other_traces=[t for t in traces if t.kind not in (TraceKind.TRANSITION, TraceKind.POLICY_DECISION,
                                                          TraceKind.HITL_DECISION)],
        audit=list(AuditLog.objects.filter(run_id=run.pk).select_related("actor").order_by("id")),
    )


def _stage_of(state: str) -> str:
    """The seed's four stages of a run's life, by the state a change entered."""
    if state in FINAL:
        return "4 · Closed"
    if state in TRANSIENT:
        return "3 · Branch (transient)"
    if state == RunState.TRACING:
        return "2 · TRACING"
    return "1 · Main path"


@dataclass
class Overview:
    counts: dict[str, int]
    per_minute: list[int]
    minute_labels: list[str]
    p50_ms: list[float | None]
    p95_ms: list[float | None]
    bucket_labels: list[str]
    zombies_last_hour: int
    zombies_total: int
    awaiting: list[Run]
    failures: list[dict]

    @property
    def duration_series(self) -> dict[str, list[float | None]]:
        return {"p50": self.p50_ms, "p95": self.p95_ms}


def overview_for(tenant: Tenant | None, *, now=None) -> Overview:
    """The overview page's figures for one tenant, over the last hour."""
    now = now or timezone.now()
    runs = Run.objects.filter(tenant=tenant) if tenant is not None else Run.objects.none()
    counts = dict(runs.values_list("state").annotate(n=Count("id")).values_list("state", "n"))
    start = (now - timedelta(hours=1)).replace(second=0, microsecond=0) + timedelta(minutes=1)
    created = list(runs.filter(created_at__gte=start).values_list("created_at", flat=True))
    per_minute = [0] * 60
    for moment in created:
        index = int((moment - start).total_seconds() // 60)
        if 0 <= index < 60:
            per_minute[index] += 1
    finished = list(runs.filter(finished_at__gte=start).values_list("finished_at", "created_at"))
    buckets: list[list[float]] = [[] for _ in range(12)]
    for end, begin in finished:
        index = int((end - start).total_seconds() // 300)
        if 0 <= index < 12:
            buckets[index].append((end - begin).total_seconds() * 1000)
    zombies = AuditLog.objects.filter(tenant_id=getattr(tenant, "pk", None), event=AuditEvent.ZOMBIE_RECOVERED)
    failed = list(runs.filter(state=RunState.CLOSED_FAILED).order_by("-finished_at")[:10]
                  .values("id", "title", "finished_at", "closing_cause"))
    errors = _failure_codes([row["id"] for row in failed])
    return Overview(
        counts={state: counts.get(state, 0) for state in RunState.values},
        per_minute=per_minute,
        minute_labels=[(start + timedelta(minutes=i)).strftime("%H:%M") for i in range(60)],
        p50_ms=[_percentile(bucket, 50) for bucket in buckets],
        p95_ms=[_percentile(bucket, 95) for bucket in buckets],
        bucket_labels=[(start + timedelta(minutes=5 * i)).strftime("%H:%M") for i in range(12)],
        zombies_last_hour=zombies.filter(created_at__gte=start).count(),
        zombies_total=zombies.count(),
        awaiting=list(runs.filter(state=RunState.AWAITING_HITL).defer(*Run.BULKY_FIELDS)
                      .order_by("last_state_change_at")[:20]),
        failures=[{**row, "error": errors.get(row["id"])} for row in failed],
    )


def _failure_codes(run_ids: list[int]) -> dict[int, dict]:
    """The error envelope each run failed with (the trace of its FAILED or TIMEOUT edge)."""
    errors = {}
    for run_id, error in (Trace.objects.filter(run_id__in=run_ids, to_state__in=[RunState.FAILED, RunState.TIMEOUT])
                          .exclude(error=None).order_by("id").values_list("run_id", "error")):
        errors.setdefault(run_id, error)
    return errors


def _percentile(values: list[float], percent: int) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, max(0, round(percent / 100 * len(ordered)) - 1))], 1)


def hosts_overview() -> list[HostCapacity]:
    """The worker hosts (installation-wide: no tenant's data is on them),
    each with what is available of every counter of its ledger."""
    available = {f"{name}_available": F(f"{name}_capacity") - F(f"{name}_reserved")
                 for name in ("task_slots", "memory_bytes", "pids")}
    return list(HostCapacity.objects.annotate(**available).order_by("host"))
