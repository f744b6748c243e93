"""Tenant-scoped reads. Every API and page read of runs goes through here."""

from django.db.models import QuerySet

from runs.models import Event, Job, MemoryEntry, Run, Tenant


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
