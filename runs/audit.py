"""The one writer of AuditLog rows, and the hash chain that makes them
tamper-evident.

Every row names an ``AuditEvent``. Most rows commit with the change they
record, on the caller's connection. A row that must outlive the rollback of
the caller's transaction (an illegal or lost transition, a refused request)
is written ``independently``: on PostgreSQL through the second ("audit")
connection, which commits on its own. SQLite has a single writer and the
caller's open transaction holds it, so there such a row can only ride with
that transaction; outside a transaction both commit at once anyway.

The chain: the rows of one tenant's lane (``chain_lane``) are numbered by
``chain_seq`` and each stores ``row_hash`` = SHA-256 of the canonical JSON
of its content, which includes ``prev_hash``, the ``row_hash`` of the row
before it in its lane (``GENESIS`` for the first). The writer locks the
lane's ``AuditChainHead`` row for the rest of its transaction and reads
the last link there, so writers never fork a lane; the unique (tenant,
lane, chain_seq) constraint refuses a fork even if they did.

A tenant's lanes: the rows written independently on the audit connection
(lane 1), and those that ride with the caller's transaction, in lanes 0,
2, 3, … (``EXECGO_AUDIT_LANES`` of them). An independent row is often
written by a transaction that already holds one of its tenant's caller
lanes (a run that moved, then tried an illegal edge): on one chain it would
wait for a lock its own caller holds until that caller ends, which is
never. The audit connection's transactions hold only lane-1 heads and
commit at once, so no writer ever waits on itself.

Caller lanes exist so that one tenant's transactions do not queue behind
one another: a head stays locked until its transaction commits, and with
one head per tenant every audited transition of a tenant waited for the
one before it to commit (``bench/bench_audit_chain.py`` measured a quarter
of the throughput of a lane each with 8 writers). On PostgreSQL a
transaction's first row takes the lowest lane no other transaction holds
(a transaction-level advisory lock, tried without waiting while one is
free) and its later rows stay in that lane. A lone writer always writes lane 0. On SQLite, which
has one writer at a time anyway, every caller row goes to lane 0. Each
lane is verified like the one chain before: a row edited, removed,
inserted or moved within its lane breaks it, and its head names its last
link.

The hashed content is exactly what ``execgo_audit_export`` writes, minus
``id`` and ``row_hash`` (``runs.audit_hash``), so ``tools/verify_audit.py``
checks an export with nothing but the standard library.
"""

from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.db import connection, connections, transaction
from django.utils import timezone

from runs import recording
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
    """Append one row (stamped now). Inside a ``recording.holding`` block a
    row that commits with the caller's transaction is held, and linked and
    written with the block's other rows at its end."""
    row = AuditLog(run_id=run_id, tenant_id=tenant_id, event=event, actor=user_or_none(actor), caller=caller,
                   forced_by=forced_by, from_state=from_state, to_state=to_state, data=json_roundtrip(data or {}),
                   created_at=timezone.now())
    alias = "audit" if independently and connection.in_atomic_block and not settings.IS_SQLITE else "default"
    held = recording.held()
    if held is not None and alias == "default":
        held.audit_rows.append(row)
        return
    # No savepoint: inside the caller's transaction a failure here must roll
    # that transaction back (a head advanced without its row, or the
    # reverse, can never commit).
    with transaction.atomic(using=alias, savepoint=False):
        statements.write_together([[row]], chained([row], using=alias), using=alias)


def user_or_none(actor: Any):
    """The user to name as actor: agents and people are users; an anonymous
    caller or a process (the sweeper, recovery) is named by ``caller``."""
    return actor if getattr(actor, "is_authenticated", False) else None


def chained(rows: list[AuditLog], *, using: str) -> list[tuple[type[AuditChainHead], dict, dict]]:
    """Link ``rows``, in order, into their tenants' chains: each chain's
    lane chosen and its head locked for the rest of the transaction (one
    round trip a chain), and each row's ``chain_lane``, ``chain_seq``,
    ``prev_hash`` and ``row_hash`` set. Returns the heads' updates, for the
    caller to write in the same transaction as the rows."""
    heads: dict[int, tuple[int, int, str]] = {}
    for row in rows:
        chain = row.tenant_id or NO_TENANT_CHAIN
        if chain not in heads:
            heads[chain] = _lock_lane(chain, using, run_id=row.run_id)
        lane, seq, last_hash = heads[chain]
        row.chain_lane, row.chain_seq, row.prev_hash = lane, seq + 1, last_hash or GENESIS
        row.row_hash = row_digest(row_content(row))
        heads[chain] = (lane, row.chain_seq, row.row_hash)
    return [(AuditChainHead, {"chain": chain, "lane": lane}, {"seq": seq, "last_hash": last_hash})
            for chain, (lane, seq, last_hash) in heads.items()]


def _lock_lane(chain: int, using: str, *, run_id: int | None) -> tuple[int, int, str]:
    """The lane of ``chain`` this transaction's rows go to, its head locked:
    (lane, seq, last_hash)."""
    if using == "audit":
        return (INDEPENDENT_LANE, *_lock_head(chain, INDEPENDENT_LANE, using))
    if settings.IS_SQLITE:  # one writer at a time anyway: one caller lane
        return (CALLER_LANE, *_lock_head(chain, CALLER_LANE, using))
    # Locks in one order, the run's row before its tenant's head: a
    # transaction that audited first and drove the run after would
    # otherwise deadlock with one that holds the run and audits. (Not on
    # the audit connection: its caller may hold the run.)
    return _lock_free_lane(chain, using, run_id=run_id)


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


def _lock_free_lane(chain: int, using: str, *, run_id: int | None = None) -> tuple[int, int, str]:
    """PostgreSQL: lock the run's row (``run_id``, when the row is a run's),
    take a caller lane of ``chain`` that no other transaction holds, lock
    its head and return (lane, seq, last_hash): this transaction's own lane
    when it has audited before (so a transaction holds one lane of a chain),
    else the lowest free one (a lone writer always writes lane 0). A lane is
    held by a transaction-level advisory lock, taken with
    ``pg_try_advisory_xact_lock``, which never waits: one tenant's writers
    do not queue behind each other's transactions until all
    ``EXECGO_AUDIT_LANES`` lanes are held at once, and a lane's head row,
    missing or not, is only ever touched by its holder. With every lane held
    the writer waits for lane 0, holding no lane of that chain itself (its
    own would have been free to it), so it cannot deadlock there.

    The common case is one round trip: the run's lock (an InitPlan, so it
    is taken first), the lane and the head's upsert in one statement."""
    conn = connections[using]
    held_transaction, held_lanes = getattr(conn, "execgo_audit_lanes", ("", ()))
    lanes = caller_lanes()
    head = conn.ops.quote_name(AuditChainHead._meta.db_table)
    run_table, run_pk = conn.ops.quote_name(Run._meta.db_table), conn.ops.quote_name(Run._meta.pk.column)
    with conn.cursor() as cursor:
        # Without ORDER BY the function scan hands the lanes over in order and
        # LIMIT stops at the first one locked: no other lane is taken.
        cursor.execute(
            "WITH chosen AS (SELECT lane FROM unnest("
            "CASE WHEN pg_current_xact_id()::text = %s THEN %s::int[] ELSE '{}'::int[] END || %s::int[]) AS lane "
            f"WHERE (SELECT count(*) FROM (SELECT 1 FROM {run_table} WHERE {run_pk} = %s FOR UPDATE) AS run) >= 0 "
            f"AND pg_try_advisory_xact_lock({LANE_LOCK_KEY}) LIMIT 1) "
            f"INSERT INTO {head} (chain, lane, seq, last_hash) SELECT %s, lane, 0, '' FROM chosen "
            f"ON CONFLICT (chain, lane) DO UPDATE SET seq = {head}.seq "
            "RETURNING lane, seq, last_hash, pg_current_xact_id()::text",
            [held_transaction, list(held_lanes), lanes, run_id, chain, chain])
        found = cursor.fetchone()
        if found is not None:
            lane, seq, last_hash, transaction_id = found
        else:  # every lane held by other transactions: wait for one (the run's row is locked by now)
            lane = lanes[0]
            cursor.execute(f"SELECT pg_advisory_xact_lock({LANE_LOCK_KEY}), pg_current_xact_id()::text "
                           "FROM (SELECT %s::int AS lane) AS chosen", [chain, lane])
            transaction_id = cursor.fetchone()[1]
            seq, last_hash = _lock_head(chain, lane, using)
    conn.execgo_audit_lanes = (transaction_id, (*held_lanes, lane) if held_transaction == transaction_id else (lane,))
    return lane, seq, last_hash


# The advisory lock of a caller lane: a negative key (chain × -1024 - lane - 1), apart from
# any positive key, one per (chain, lane) while there are fewer than 1024 lanes.
LANE_LOCK_KEY = "%s::bigint * -1024 - lane - 1"


def caller_lanes() -> list[int]:
    """The lanes of rows committed with the caller's transaction: 0, then
    2, 3, … (1 is the independent lane), ``EXECGO_AUDIT_LANES`` in all."""
    count = max(1, min(settings.EXECGO_AUDIT_LANES, 1000))  # the lock keys leave room for 1023
    return [CALLER_LANE, *range(INDEPENDENT_LANE + 1, INDEPENDENT_LANE + count)]


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
