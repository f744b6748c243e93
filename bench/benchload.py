"""What the load benches share: their set-up (prepare), their agents (each
an "agents" user of a tenant of its own, with an API token), their Redis
queues emptied, waiting for runs to end, percentiles and overlaps (the
processes they start: benchprocs). ``prepare`` sets Django up; the others
that read the database are called after it."""

import os
import statistics
import time
from pathlib import Path

from benchdb import ensure_database

FINAL = ("SUCCEEDED", "CLOSED_FAILED", "CLOSED_REJECTED", "CLOSED_CANCELLED")


def purge_queues() -> None:
    """Drops the messages a bench interrupted earlier left on its Redis db:
    the default queue and this host's own and capability queues, the ones
    its worker consumes."""
    from execgo.celery import app
    from runs.dataplane import capability_queues, current_host, host_capabilities, host_queue

    for queue in (host_queue(current_host()), *capability_queues(host_capabilities())):
        app.amqp.queues.select_add(queue)
    app.control.purge()


def prepare(prefix: str, tenants: int) -> tuple[Path, list[tuple[object, str]]]:
    """The bench's data directory and database (created when missing, then
    migrated), Django set up, its queues emptied, and its agents
    (make_agents). Returns the data directory and the agents' tokens."""
    data_dir = Path(os.environ["EXECGO_DATA_DIR"])
    data_dir.mkdir(parents=True, exist_ok=True)
    ensure_database(os.environ["DATABASE_URL"])
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    purge_queues()
    return data_dir, make_agents(prefix, tenants)


def make_agents(prefix: str, tenants: int) -> list[tuple[object, str]]:
    """One agent per tenant (``{prefix}-{i}``): a user of the "agents" group
    with its membership, and a new API token. Returns (token, key) pairs."""
    from django.contrib.auth.models import Group, User

    from runs.models import Membership, Tenant
    from runs.tokens import token_create

    agents = Group.objects.get_or_create(name="agents")[0]
    tokens = []
    for index in range(tenants):
        tenant = Tenant.objects.get_or_create(name=f"{prefix}-{index}")[0]
        user = User.objects.get_or_create(username=f"{prefix}-agent-{index}")[0]
        Membership.objects.get_or_create(user=user, defaults={"tenant": tenant})
        user.groups.add(agents)
        tokens.append(token_create(user=user, name="bench", expires_at=None, caller="bench"))
    return tokens


def revoke(tokens: list[tuple[object, str]]) -> None:
    from runs.tokens import token_revoke

    for token, _key in tokens:
        token_revoke(token=token, caller="bench")


def wait_final(run_ids: list[int], bound_s: float, poll_s: float = 0.5) -> float:
    """Waits until every run of ``run_ids`` is final, ``bound_s`` at most;
    returns the seconds waited."""
    from runs.models import Run

    started = time.monotonic()
    while run_ids and Run.objects.filter(pk__in=run_ids).exclude(state__in=FINAL).exists():
        if time.monotonic() - started > bound_s:
            break
        time.sleep(poll_s)
    return time.monotonic() - started


def percentiles(samples: list[float], points: tuple[int, ...]) -> dict[int, float]:
    """The given percentiles of ``samples`` (inclusive method: within the
    samples' range even for few of them)."""
    if not samples:
        return {point: float("nan") for point in points}
    if len(samples) == 1:
        return {point: samples[0] for point in points}
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return {point: cuts[point - 1] for point in points}


def peak_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals (start, end) open at one instant; an interval
    ending at the instant another starts does not overlap it."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak
