"""The one writer of AuditLog rows, and the hash chain that makes them
tamper-evident.

Every row names an ``AuditEvent``. Most rows commit with the change they
record, on the caller's connection. A row that must outlive the rollback of
the caller's transaction (an illegal or lost transition, a refused request)
is written ``independently``: on PostgreSQL through the second ("audit")
connection, which commits on its own. SQLite has a single writer and the
caller's open transaction holds it, so there such a row can only ride with
that transaction; outside a transaction both commit at once anyway.

The chain: the rows of one tenant are numbered by ``chain_seq`` and each
stores ``row_hash`` = SHA-256 of the canonical JSON of its content, which
includes ``prev_hash``, the ``row_hash`` of the row before it (``GENESIS``
for the first). The writer locks the chain's ``AuditChainHead`` row for the
rest of its transaction (an upsert that returns the last link), so
concurrent writers of a tenant queue there and never fork the chain; the
unique (tenant, lane, chain_seq) constraint refuses a fork even if they did.

A tenant has two chains, one per connection (``chain_lane``): rows that ride
with the caller's transaction (lane 0), and rows written independently on
the audit connection (lane 1). An independent row is often written by a
transaction that already holds its tenant's lane-0 head (a run that moved,
then tried an illegal edge): on one chain it would wait for a lock its own
caller holds until that caller ends, which is never. The audit connection's
transactions hold only lane-1 heads and commit at once, so no writer ever
waits on itself.

The hashed content is exactly what ``execgo_audit_export`` writes, minus
``id`` and ``row_hash`` (``runs.audit_hash``), so ``tools/verify_audit.py``
checks an export with nothing but the standard library.
"""

from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.db import connection, connections, transaction
from django.utils import timezone

from runs.audit_hash import (
    CALLER_LANE,
    GENESIS,
    INDEPENDENT_LANE,
    NO_TENANT_CHAIN,
    json_roundtrip,
    row_content,
    row_digest,
)
from runs.models import AuditChainHead, AuditEvent, AuditLog, Run
from runtime import statements


def audit(event: AuditEvent, *, run_id: int | None, tenant_id: int | None, actor: Any = None, caller: str = "",
          forced_by: str = "", from_state: str = "", to_state: str = "", data: dict[str, Any] | None = None,
          independently: bool = False) -> None:
    row = AuditLog(run_id=run_id, tenant_id=tenant_id, event=event, actor=user_or_none(actor), caller=caller,
                   forced_by=forced_by, from_state=from_state, to_state=to_state, data=json_roundtrip(data or {}))
    alias = "audit" if independently and connection.in_atomic_block and not settings.IS_SQLITE else "default"
    _append(row, using=alias)


def user_or_none(actor: Any):
    """The user to name as actor: agents and people are users; an anonymous
    caller or a process (the sweeper, recovery) is named by ``caller``."""
    return actor if getattr(actor, "is_authenticated", False) else None


def _append(row: AuditLog, *, using: str) -> None:
    row.chain_lane = INDEPENDENT_LANE if using == "audit" else CALLER_LANE
    # No savepoint: inside the caller's transaction a failure here must roll
    # that transaction back (a head advanced without its row, or the
    # reverse, can never commit).
    with transaction.atomic(using=using, savepoint=False):
        if row.run_id is not None and row.chain_lane == CALLER_LANE and not settings.IS_SQLITE:
            # Locks in one order, the run's row before its tenant's head: a
            # transaction that audited first and drove the run after would
            # otherwise deadlock with one that holds the run and audits.
            # (Not on the audit connection: its caller may hold the run.)
            statements.select_for_update(Run, row.run_id, ("id",), using=using)
        seq, last_hash = _lock_head(row.tenant_id or NO_TENANT_CHAIN, row.chain_lane, using)
        row.chain_seq = seq + 1
        row.prev_hash = last_hash or GENESIS
        row.created_at = timezone.now()
        row.row_hash = row_digest(row_content(row))
        statements.insert([row], using=using)
        statements.update(AuditChainHead, {"chain": row.tenant_id or NO_TENANT_CHAIN, "lane": row.chain_lane},
                          {"seq": row.chain_seq, "last_hash": row.row_hash}, using=using)


def _lock_head(chain: int, lane: int, using: str) -> tuple[int, str]:
    """Lock the chain's head row (creating it) until the transaction ends,
    and read its last link. An upsert, so a chain's first two writers do
    not race on creating it: the second waits on the first's row."""
    conn = connections[using]
    table = conn.ops.quote_name(AuditChainHead._meta.db_table)
    with conn.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (chain, lane, seq, last_hash) VALUES (%s, %s, 0, '') "
            f"ON CONFLICT (chain, lane) DO UPDATE SET seq = {table}.seq RETURNING seq, last_hash",
            [chain, lane],
        )
        seq, last_hash = cursor.fetchone()
    return seq, last_hash


# --- SQLite: the connection-level flag that lets a flush empty the table -----

@contextmanager
def sqlite_audit_erasable(conn):
    """On SQLite the triggers refuse to delete an audit row or a chain head
    unless this connection's ``execgo_audit_erasable()`` says 1: only inside
    this block.
    ``manage.py flush`` (and so the test suite's flush) runs inside it."""
    previous = getattr(conn, "execgo_audit_erasable", False)
    conn.execgo_audit_erasable = True
    try:
        yield
    finally:
        conn.execgo_audit_erasable = previous


def erase_audit_log(using: str = "default") -> None:
    """Empty the audit log and its chain heads, as a flush does: TRUNCATE on
    PostgreSQL (its trigger refuses DELETE; TRUNCATE needs a privilege the
    application's role should not have in production), the connection flag on
    SQLite. For tests that start again from nothing between examples."""
    conn = connections[using]
    if conn.vendor == "postgresql":
        with conn.cursor() as cursor:
            cursor.execute(f"TRUNCATE {AuditLog._meta.db_table}, {AuditChainHead._meta.db_table}")
        return
    with sqlite_audit_erasable(conn):
        AuditLog.objects.using(using).all().delete()
        AuditChainHead.objects.using(using).all().delete()


def install_sqlite_guard(sender, connection, **kwargs) -> None:
    """``connection_created`` receiver: the SQL function the SQLite trigger
    asks, and a flush that sets it. A connection without the function (the
    sqlite3 shell) fails the trigger's WHEN clause: the delete is refused."""
    if connection.vendor != "sqlite":
        return
    connection.connection.create_function(
        "execgo_audit_erasable", 0, lambda: int(getattr(connection, "execgo_audit_erasable", False))
    )
    ops = connection.ops
    if not getattr(ops, "_execgo_flush_guarded", False):
        execute_sql_flush = ops.execute_sql_flush

        def flush_erasing_audit(sql_list):
            with sqlite_audit_erasable(connection):
                execute_sql_flush(sql_list)

        ops.execute_sql_flush = flush_erasing_audit
        ops._execgo_flush_guarded = True
