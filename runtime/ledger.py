"""Resource ledger: reserve before launching, release on every terminal path.

``reserve`` is one compare-and-swap UPDATE whose WHERE clause holds
``reserved + n <= capacity`` for every counter, so two workers racing for
the last slot cannot both win, on PostgreSQL or SQLite. ``release`` deletes
the Reservation row and only the caller whose DELETE removed it gives the
amounts back, so a duplicate release (retry, recovery, a redelivered task)
is harmless. ``recover`` rebuilds the counters from the Reservation rows
when a worker starts, dropping rows for steps that are no longer running.

Every reservation names its owner: the process that made it (pid and start
time, on the reservation's host). A Celery pool process killed mid-step
never releases what it holds, and its worker goes on (a new pool process
replaces it): ``reclaim`` gives back the reservations of owners that are
gone (a pid that no longer exists, a zombie, or a pid reused by a process
started at another time) without waiting for a worker restart, and tells
the caller what it reclaimed so the harness can audit it and re-attach the
steps involved. Nothing here waits without bound: ``wait_for_reservation``
gives up after ``EXECGO_LEDGER_WAIT_S`` and the caller re-queues.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from functools import lru_cache
from typing import Any

import psutil
from django.conf import settings
from django.db import IntegrityError, connections, transaction
from django.db.models import F, Sum
from django.utils import timezone

from runtime import shim_process, statements
from runtime.capabilities import capability_manifest, host_name
from runtime.envelopes import EnvelopeError
from runtime.models import HostCapacity, Reservation

COUNTERS = ("task_slots", "memory_bytes", "pids")
# A process's start time is read in seconds after boot (its start in clock
# ticks): the same process always reads the same, a reused pid reads later,
# and setting the wall clock changes neither (an epoch time would move with
# the kernel's btime and make every live owner look dead).
START_TIME_TOLERANCE_S = 0.05

_owner: dict[int, tuple[int, float]] = {}


def current_owner() -> tuple[int, float]:
    """This process as a reservation owner: (pid, start time). Cached per
    pid, so a forked pool process names itself, not its parent."""
    pid = os.getpid()
    if pid not in _owner:
        _owner[pid] = (pid, process_started_at(pid))
    return _owner[pid]


def process_started_at(pid: int) -> float:
    """When pid started, in seconds after boot. Raises OSError once it is gone."""
    return shim_process.process_create_time(pid)


def owner_alive(pid: int, started_at: float | None) -> bool:
    """Whether the process that made a reservation still runs on this host."""
    try:
        if started_at is not None and abs(process_started_at(pid) - started_at) > START_TIME_TOLERANCE_S:
            return False  # the pid was reused by another process
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (OSError, psutil.NoSuchProcess):
        return False


def host_register(
    host: str | None = None,
    *,
    task_slots: int | None = None,
    memory_bytes: int | None = None,
    pids: int | None = None,
    capabilities: dict[str, Any] | None = None,
) -> HostCapacity:
    """Create or refresh this host's ledger row (capacities default to the probe and settings)."""
    host = host or host_name()
    if capabilities is None:
        capabilities = capability_manifest()
    wanted = {
        "task_slots": (task_slots or settings.EXECGO_TASK_SLOTS
                       or capabilities["cpu"]["logical"] * settings.EXECGO_TASK_SLOTS_PER_CPU),
        "memory_bytes": memory_bytes or settings.EXECGO_MEMORY_BYTES or capabilities["memory"]["total_bytes"],
        "pids": pids or settings.EXECGO_PIDS_CAPACITY,
    }
    with transaction.atomic():
        row, _ = HostCapacity.objects.select_for_update().get_or_create(
            host=host, defaults={f"{name}_capacity": value for name, value in wanted.items()}
        )
        for name, value in wanted.items():
            # Never below what is reserved right now (the CHECK would refuse it).
            setattr(row, f"{name}_capacity", max(int(value), getattr(row, f"{name}_reserved")))
        row.capabilities = capabilities
        row.last_seen = timezone.now()
        row.save()
    return row


def _amounts(slots: int, memory_bytes: int, pids: int) -> dict[str, int]:
    amounts = {"task_slots": slots, "memory_bytes": memory_bytes, "pids": pids}
    for name, value in amounts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise EnvelopeError.of("invalid_input", f"{name} must be a non-negative integer", source="scheduler")
    return amounts


def reserve(
    host: str, handle_id: str, *, slots: int = 1, memory_bytes: int = 0, pids: int = 0, waited_ms: int = 0
) -> bool:
    """Reserve for handle_id if it fits now; True if reserved (or already
    was). A reservation of handle_id held by an owner that is gone, or by
    none, is adopted by this process (a re-attached step)."""
    amounts = _amounts(slots, memory_bytes, pids)
    pid, started_at = current_owner()
    on_postgres = connections[Reservation.objects.db].vendor == "postgresql"
    if on_postgres and _reserve_at_once(host, handle_id, amounts, waited_ms=waited_ms, owner=(pid, started_at)):
        return True  # else it did not fit, or handle_id has a reservation already: seen below
    existing = Reservation.objects.filter(handle_id=handle_id).values("pk", "owner_pid", "owner_started_at").first()
    if existing is not None:
        if existing["owner_pid"] != pid and (existing["owner_pid"] is None or not owner_alive(
                existing["owner_pid"], existing["owner_started_at"])):
            Reservation.objects.filter(pk=existing["pk"], owner_pid=existing["owner_pid"]).update(
                owner_pid=pid, owner_started_at=started_at)
        return True
    if on_postgres:
        return False  # no reservation, and it did not fit
    fits = {f"{name}_reserved__lte": F(f"{name}_capacity") - value for name, value in amounts.items()}
    grow = {f"{name}_reserved": F(f"{name}_reserved") + value for name, value in amounts.items()}
    try:
        with transaction.atomic():
            if HostCapacity.objects.filter(host=host, **fits).update(**grow) == 0:
                return False
            Reservation.objects.create(host_id=host, handle_id=handle_id, waited_ms=waited_ms, owner_pid=pid,
                                       owner_started_at=started_at, **amounts)
    except IntegrityError:
        # A concurrent reserve for the same handle created the row first;
        # ours rolled back together with its counter update.
        return Reservation.objects.filter(handle_id=handle_id).exists()
    return True


def _reserve_at_once(host: str, handle_id: str, amounts: dict[str, int], *, waited_ms: int,
                     owner: tuple[int, float]) -> bool:
    """``reserve``'s compare-and-swap in one statement on PostgreSQL (no
    savepoint, no read before it): the host's row locked if the amounts fit
    (re-checked on its latest version when another writer held it), the
    reservation inserted unless ``handle_id`` already has one, and the
    counters grown only by an insert that happened. False when nothing was
    reserved."""
    using = Reservation.objects.db
    now = Reservation._meta.get_field("reserved_at").get_db_prep_save(timezone.now(), connection=connections[using])
    params = [host, *amounts.values(), handle_id, *amounts.values(), now, waited_ms, *owner, *amounts.values()]
    with connections[using].cursor() as cursor:
        cursor.execute(_reserve_sql(using), params)
        return cursor.rowcount > 0


@lru_cache(maxsize=None)
def _reserve_sql(using: str) -> str:
    quote = connections[using].ops.quote_name
    reservation, capacity = Reservation._meta, HostCapacity._meta

    def counter(name: str, kind: str) -> str:
        return quote(capacity.get_field(f"{name}_{kind}").column)

    def column(name: str) -> str:
        return quote(reservation.get_field(name).column)

    fits = " AND ".join(f"{counter(name, 'reserved')} <= {counter(name, 'capacity')} - %s" for name in COUNTERS)
    inserted = ("host", "handle_id", *COUNTERS, "reserved_at", "waited_ms", "owner_pid", "owner_started_at")
    grown = ", ".join(f"{counter(name, 'reserved')} = h.{counter(name, 'reserved')} + %s" for name in COUNTERS)
    host_column = quote(capacity.pk.column)
    return (f"WITH fits AS (SELECT {host_column} FROM {quote(capacity.db_table)} "
            f"WHERE {host_column} = %s AND {fits} FOR UPDATE), "
            f"made AS (INSERT INTO {quote(reservation.db_table)} ({', '.join(column(name) for name in inserted)}) "
            f"SELECT {host_column}, {', '.join(['%s'] * (len(inserted) - 1))} FROM fits "
            f"ON CONFLICT ({column('handle_id')}) DO NOTHING RETURNING {column('host')}) "
            f"UPDATE {quote(capacity.db_table)} AS h SET {grown} FROM made WHERE h.{host_column} = made.{column('host')}")


def transfer(from_handle: str, to_handle: str, *, host: str, slots: int = 1, memory_bytes: int = 0,
             pids: int = 0) -> bool:
    """Hand a reservation over to the next step on the same host when it
    needs exactly the same amounts: one UPDATE instead of a release and a
    reserve, and the slot is never free in between. False, and nothing
    changed, when there is no such reservation."""
    amounts = _amounts(slots, memory_bytes, pids)
    pid, started_at = current_owner()
    return statements.update(Reservation, {"handle_id": from_handle, "host_id": host, **amounts},
                             {"handle_id": to_handle, "reserved_at": timezone.now(), "waited_ms": 0,
                              "owner_pid": pid, "owner_started_at": started_at}) == 1


def hand_over(handle_id: str, pid: int) -> bool:
    """Make process ``pid`` of this host the owner of ``handle_id``'s
    reservation (a step handed to its worker's watcher, ``runtime.watcher``);
    False when there is no such reservation (already released)."""
    return Reservation.objects.filter(handle_id=handle_id).update(
        owner_pid=pid, owner_started_at=process_started_at(pid)) == 1


def release(handle_id: str, *, only_mine: bool = False) -> bool:
    """Give back handle_id's reservation; False if there was none (already
    released). ``only_mine``: only if this process owns it (a claim that
    lost its race must not give back the winner's slot)."""
    owner = current_owner()[0] if only_mine else None
    if connections[Reservation.objects.db].vendor == "postgresql":
        return _give_back_at_once(handle_id, owner)
    rows = Reservation.objects.filter(handle_id=handle_id)
    if only_mine:
        rows = rows.filter(owner_pid=owner)
    row = rows.first()
    return row is not None and _give_back(row)


def _give_back_at_once(handle_id: str, owner: int | None) -> bool:
    """``release`` in one statement on PostgreSQL: the row deleted in a
    data-modifying WITH, its amounts given back by the UPDATE that reads
    what the DELETE returned (a concurrent release deletes nothing and so
    gives back nothing)."""
    using = Reservation.objects.db
    with connections[using].cursor() as cursor:
        cursor.execute(_give_back_sql(using, owner is not None), [handle_id] if owner is None else [handle_id, owner])
        return cursor.rowcount > 0


@lru_cache(maxsize=None)
def _give_back_sql(using: str, mine: bool) -> str:
    """``_give_back_at_once``'s statement, compiled once per connection and
    filter (it runs once a step)."""
    quote = connections[using].ops.quote_name
    reservation, capacity = Reservation._meta, HostCapacity._meta
    column = {name: quote(reservation.get_field(name).column) for name in ("handle_id", "owner_pid", "host", *COUNTERS)}
    owned = f" AND {column['owner_pid']} = %s" if mine else ""
    given = ", ".join(f"{quote(capacity.get_field(f'{name}_reserved').column)} = "
                      f"h.{quote(capacity.get_field(f'{name}_reserved').column)} - gone.{column[name]}"
                      for name in COUNTERS)
    return (f"WITH gone AS (DELETE FROM {quote(reservation.db_table)} WHERE {column['handle_id']} = %s{owned} "
            f"RETURNING {column['host']}, {', '.join(column[name] for name in COUNTERS)}) "
            f"UPDATE {quote(capacity.db_table)} AS h SET {given} FROM gone "
            f"WHERE h.{quote(capacity.pk.column)} = gone.{column['host']}")


def _give_back(row: Reservation) -> bool:
    """Delete ``row`` and return its amounts; only the caller whose DELETE
    removed it does, so concurrent releases and reclaims count it once."""
    with transaction.atomic():
        deleted, _ = Reservation.objects.filter(pk=row.pk, owner_pid=row.owner_pid).delete()
        if not deleted:
            return False  # another release won the DELETE and gave the amounts back
        HostCapacity.objects.filter(host=row.host_id).update(
            **{f"{name}_reserved": F(f"{name}_reserved") - getattr(row, name) for name in COUNTERS}
        )
    return True


def reclaim(host: str | None = None, *, in_flight: Callable[[Iterable[str]], set[str]] | None = None,
            unowned_after_s: float = 5.0) -> list[dict[str, Any]]:
    """Give back this host's reservations whose owner is gone; return them
    (handle, owner, amounts, why) for the caller to audit.

    A reservation held by no owner (kept by ``recover`` for a shim still
    running, until its re-attachment adopts it) is reclaimed too once it is
    older than ``unowned_after_s`` and ``in_flight(handles)`` no longer
    lists its handle. Only rows of this host are judged: a pid means
    something only on the host it was read on.
    """
    host = host or host_name()
    # A heal runs on the host it judges: it also says the host is alive.
    HostCapacity.objects.filter(host=host).update(last_seen=timezone.now())
    rows = list(Reservation.objects.filter(host_id=host))
    unowned_before = timezone.now() - timedelta(seconds=unowned_after_s)
    unowned = [row for row in rows if row.owner_pid is None and row.reserved_at < unowned_before]
    still_wanted = in_flight([row.handle_id for row in unowned]) if (in_flight and unowned) else set()
    reclaimed = []
    for row in rows:
        if row.owner_pid is not None:
            if owner_alive(row.owner_pid, row.owner_started_at):
                continue
            why = "owner_gone"
        elif row in unowned and in_flight is not None and row.handle_id not in still_wanted:
            why = "unowned"
        else:
            continue
        if _give_back(row):
            reclaimed.append({"handle_id": row.handle_id, "host": host, "owner_pid": row.owner_pid,
                              "owner_started_at": row.owner_started_at, "reason": why,
                              "reserved_at": row.reserved_at.isoformat(),
                              **{name: getattr(row, name) for name in COUNTERS}})
    return reclaimed


def wait_for_reservation(
    host: str,
    handle_id: str,
    *,
    slots: int = 1,
    memory_bytes: int = 0,
    pids: int = 0,
    timeout_s: float | None = None,
    poll_interval: float = 0.05,
) -> float:
    """Reserve, waiting while the host is full, at most ``timeout_s``
    (default ``EXECGO_LEDGER_WAIT_S``); returns the seconds waited.

    Raises invalid_input when the request can never fit this host, and a
    retryable timeout error when timeout_s passes first (the caller hands
    the attempt back to the queue rather than hold its process).
    """
    if timeout_s is None:
        timeout_s = settings.EXECGO_LEDGER_WAIT_S
    amounts = _amounts(slots, memory_bytes, pids)
    capacity = HostCapacity.objects.filter(host=host).first()
    if capacity is None:
        raise EnvelopeError.of("not_found", f"host {host} has no ledger row", source="scheduler")
    too_big = [name for name, value in amounts.items() if value > getattr(capacity, f"{name}_capacity")]
    if too_big:
        raise EnvelopeError.of(
            "invalid_input",
            f"request exceeds the capacity of host {host}: {', '.join(too_big)}",
            source="scheduler",
            details={name: amounts[name] for name in too_big},
        )
    start = time.monotonic()
    delay = min(0.005, poll_interval)
    while not reserve(host, handle_id, waited_ms=int((time.monotonic() - start) * 1000), **_keywords(amounts)):
        if time.monotonic() - start >= timeout_s:
            raise EnvelopeError.of(
                "timeout",
                f"no capacity on host {host} within {timeout_s}s",
                retryable=True,
                source="scheduler",
                details={"waited_ms": int((time.monotonic() - start) * 1000)},
            )
        time.sleep(delay * random.uniform(0.5, 1.5))  # jitter: waiters do not retry in lockstep
        delay = min(delay * 2, poll_interval)
    return time.monotonic() - start


def _keywords(amounts: dict[str, int]) -> dict[str, int]:
    return {"slots": amounts["task_slots"], "memory_bytes": amounts["memory_bytes"], "pids": amounts["pids"]}


def recover(host: str | None = None, *, keep: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """Rebuild host counters from Reservation rows (worker start).

    ``keep(handle_id)`` decides which reservations still belong to a running
    step (e.g. ``runtime.attach.shim_alive``); the others are dropped.
    """
    host = host or host_name()
    dropped: list[str] = []
    with transaction.atomic():
        row = HostCapacity.objects.select_for_update().get(host=host)
        if keep is not None:
            for handle_id in Reservation.objects.filter(host=row).values_list("handle_id", flat=True):
                if not keep(handle_id):
                    dropped.append(handle_id)
            Reservation.objects.filter(handle_id__in=dropped).delete()
            # What is kept belongs to a shim whose worker died: it waits,
            # unowned, for the re-attachment to adopt it (``reserve``).
            Reservation.objects.filter(host=row).update(owner_pid=None, owner_started_at=None)
        sums = Reservation.objects.filter(host=row).aggregate(**{name: Sum(name) for name in COUNTERS})
        for name in COUNTERS:
            reserved = sums[name] or 0
            setattr(row, f"{name}_reserved", reserved)
            setattr(row, f"{name}_capacity", max(getattr(row, f"{name}_capacity"), reserved))
        row.last_seen = timezone.now()
        row.save()
    return {"host": host, "dropped": dropped, **{f"{name}_reserved": sums[name] or 0 for name in COUNTERS}}


def available(host: str) -> dict[str, int]:
    row = HostCapacity.objects.get(host=host)
    return {name: getattr(row, f"{name}_capacity") - getattr(row, f"{name}_reserved") for name in COUNTERS}
