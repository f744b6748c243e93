"""The audit log is tamper-evident: a hash chain per tenant, kept unbroken by
concurrent writers, refused UPDATE and DELETE by the database, verified by
execgo_reconcile (which names the first broken row) and, exported, by a
standard-library script."""

import importlib
import json
import re
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from django.db import DatabaseError, connection, transaction

from runs.audit import audit, sqlite_audit_erasable
from runs.audit_hash import GENESIS, row_content, row_digest
from runs.invariants import audit_chain_breaks, find_violations
from runs.models import AuditChainHead, AuditEvent, AuditLog, Tenant
from runs.transitions import recorded_at_the_end
from tests.conftest import ROOT, _worker_env, postgres_only

transactional = pytest.mark.django_db(transaction=True, databases=["default", "audit"])
MIGRATION = importlib.import_module("runs.migrations.0010_audit_hash_chain")
HEAD_MIGRATION = importlib.import_module("runs.migrations.0027_audit_head_moves_by_a_batch")
VERIFY = ROOT / "tools" / "verify_audit.py"
# Values a database may hand back differently from how they went in.
AWKWARD = {"float": 1.0, "big": 1e16, "small": 2.5e-7, "text": "ü \"quoted\" \n", "nested": {"b": [1, 2.5], "a": None},
           "tuple": (1, 2)}


def write(tenant_id: int | None, count: int, **fields) -> None:
    for index in range(count):
        audit("state_changed", run_id=None, tenant_id=tenant_id, caller=f"test {index}",
              data={"index": index, **AWKWARD}, **fields)


def chain_of(tenant_id: int | None, lane: int = 0) -> list[AuditLog]:
    return list(AuditLog.objects.filter(tenant_id=tenant_id, chain_lane=lane).order_by("chain_seq"))


def assert_unbroken(rows: list[AuditLog], *, chain: int, lane: int = 0) -> None:
    assert [row.chain_seq for row in rows] == list(range(1, len(rows) + 1))
    assert [row.prev_hash for row in rows] == [GENESIS] + [row.row_hash for row in rows[:-1]]
    assert all(row.row_hash == row_digest(row_content(row)) for row in rows)
    head = AuditChainHead.objects.get(chain=chain, lane=lane)
    assert (head.seq, head.last_hash) == (len(rows), rows[-1].row_hash)


def manage(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=_worker_env(), capture_output=True,
                          text=True, timeout=120)


def verify_offline(path: Path, *extra: str) -> subprocess.CompletedProcess:
    # -I -S: no site-packages, no environment: the standard library only.
    return subprocess.run([sys.executable, "-I", "-S", str(VERIFY), str(path), *extra], capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})


def bypassing_the_trigger(sql: str, params: list) -> None:
    """What the database's owner can do: write past the append-only trigger."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET session_replication_role = replica")
            try:
                cursor.execute(sql, params)
            finally:
                cursor.execute("SET session_replication_role = DEFAULT")
        else:
            for statement in MIGRATION.SQLITE_DROP:
                cursor.execute(statement)
            try:
                cursor.execute(sql, params)
            finally:
                for statement in MIGRATION.SQLITE_CREATE:
                    cursor.execute(statement)
                for statement in HEAD_MIGRATION.SQLITE_TRIGGER:  # the head's trigger as it stands now
                    cursor.execute(statement.replace("{step}", HEAD_MIGRATION.BY_ANY))


# --- the chain ------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_rows_form_one_chain_per_tenant(tenant, other_tenant):
    write(tenant.pk, 3)
    write(other_tenant.pk, 2)
    write(None, 2)
    write(tenant.pk, 1)

    assert_unbroken(chain_of(tenant.pk), chain=tenant.pk)
    assert_unbroken(chain_of(other_tenant.pk), chain=other_tenant.pk)
    assert_unbroken(chain_of(None), chain=0)
    assert len(chain_of(tenant.pk)) == 4
    row = chain_of(tenant.pk)[0]
    assert row.data == {"index": 0, **AWKWARD, "tuple": [1, 2]}
    assert audit_chain_breaks() == []


@pytest.mark.django_db
def test_a_row_written_around_the_writer_is_reported(tenant):
    write(tenant.pk, 1)
    stray = AuditLog.objects.create(tenant=tenant, event="run_succeeded", caller="forger")

    assert audit_chain_breaks() == [
        f"audit row {stray.pk} (tenant {tenant.pk}) is outside the chain: no chain_seq, no hash"]


@postgres_only
@transactional
def test_an_independent_row_outlives_the_rollback_in_its_own_lane(tenant):
    """The caller's transaction holds the tenant's lane-0 head; the row that
    must survive its rollback chains in lane 1 on the other connection
    instead of waiting for that head (which would be for ever)."""
    with pytest.raises(RuntimeError), transaction.atomic():
        audit("state_changed", run_id=None, tenant_id=tenant.pk, caller="rolled back")
        audit("invalid_transition", run_id=None, tenant_id=tenant.pk, caller="kept", independently=True)
        raise RuntimeError("roll the caller back")

    assert chain_of(tenant.pk) == []
    kept = chain_of(tenant.pk, lane=1)
    assert [(row.event, row.caller) for row in kept] == [("invalid_transition", "kept")]
    assert_unbroken(kept, chain=tenant.pk, lane=1)
    # The rolled-back write advanced nothing: the next lane-0 row is seq 1.
    write(tenant.pk, 1)
    assert_unbroken(chain_of(tenant.pk), chain=tenant.pk)
    assert audit_chain_breaks() == []


def write_as(caller: str, tenant_id: int, count: int) -> None:
    for index in range(count):
        audit("state_changed", run_id=None, tenant_id=tenant_id, caller=caller, data={"index": index})


def caller_lanes_of(tenant_id: int) -> dict[int, list[AuditLog]]:
    """A tenant's rows written with their callers' transactions, by lane."""
    lanes: dict[int, list[AuditLog]] = {}
    for row in AuditLog.objects.filter(tenant_id=tenant_id).exclude(chain_lane=1).order_by("chain_lane",
                                                                                             "chain_seq"):
        lanes.setdefault(row.chain_lane, []).append(row)
    return lanes


@postgres_only
@transactional
def test_concurrent_writers_keep_every_lane_unbroken(tenant):
    threads, rows_each = 8, 15
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def writer(number: int) -> None:
        try:
            barrier.wait(timeout=30)
            for index in range(rows_each):
                with transaction.atomic():
                    audit("state_changed", run_id=None, tenant_id=tenant.pk, caller=f"writer {number}",
                          data={"index": index})
                    if index % 5 == 0:
                        audit("transition_lost", run_id=None, tenant_id=tenant.pk, caller=f"writer {number}",
                              independently=True)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)
        finally:
            from django.db import connections
            connections.close_all()

    pool = [threading.Thread(target=writer, args=(number,)) for number in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(timeout=120)

    assert errors == []
    lanes, independent = caller_lanes_of(tenant.pk), chain_of(tenant.pk, lane=1)
    rows = [row for lane in lanes.values() for row in lane]
    assert len(rows) == threads * rows_each
    assert len(independent) == threads * 3
    assert {row.caller for row in rows} == {f"writer {number}" for number in range(threads)}
    for lane, lane_rows in lanes.items():
        assert_unbroken(lane_rows, chain=tenant.pk, lane=lane)
    assert_unbroken(independent, chain=tenant.pk, lane=1)
    assert audit_chain_breaks() == []


@postgres_only
@transactional
def test_a_writer_holding_a_lane_does_not_hold_up_another_and_keeps_its_lane(tenant):
    """A transaction that audited keeps its lane's head until it commits;
    another writer of the same tenant meanwhile takes a free lane at once
    instead of waiting for that commit."""
    from django.db import connections

    first_wrote, second_done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def first() -> None:
        try:
            with transaction.atomic():
                write_as("first", tenant.pk, 2)
                first_wrote.set()
                # Held open until the other writer is done (or long after a wait would show).
                second_done.wait(timeout=30)
                write_as("first", tenant.pk, 1)
        except BaseException as exc:
            errors.append(exc)
        finally:
            first_wrote.set()
            connections.close_all()

    def second() -> None:
        try:
            first_wrote.wait(timeout=30)
            with transaction.atomic():
                write_as("second", tenant.pk, 2)
            second_done.set()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    started = time.monotonic()
    pool = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(timeout=60)
    assert errors == []
    assert second_done.is_set() and time.monotonic() - started < 30  # the second never waited for the first
    lanes = caller_lanes_of(tenant.pk)
    by_caller = {caller: {row.chain_lane for rows in lanes.values() for row in rows if row.caller == caller}
                 for caller in ("first", "second")}
    # Each transaction's rows in one lane: the first's three (its last written after the
    # second's commit), the second's two in another.
    assert len(by_caller["first"]) == 1 and len(by_caller["second"]) == 1
    assert by_caller["first"] != by_caller["second"]
    assert by_caller["first"] == {0}  # the lowest free lane
    for lane, lane_rows in lanes.items():
        assert_unbroken(lane_rows, chain=tenant.pk, lane=lane)
    assert audit_chain_breaks() == []


@postgres_only
@transactional
def test_with_every_lane_held_a_writer_waits_for_one(tenant, settings):
    """Two lanes, both held by open transactions: a third writer waits (it
    holds no lane itself, so nothing can deadlock) and writes once one of
    them commits."""
    from django.db import connections

    settings.EXECGO_AUDIT_LANES = 2
    holding, release, third_done = threading.Barrier(3), threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def holder(name: str) -> None:
        try:
            with transaction.atomic():
                write_as(name, tenant.pk, 1)
                holding.wait(timeout=30)
                release.wait(timeout=30)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    def third() -> None:
        try:
            with transaction.atomic():
                write_as("third", tenant.pk, 1)
            third_done.set()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    holders = [threading.Thread(target=holder, args=(name,)) for name in ("one", "two")]
    for thread in holders:
        thread.start()
    holding.wait(timeout=30)  # both lanes held now
    waiter = threading.Thread(target=third)
    waiter.start()
    assert not third_done.wait(timeout=1.0)  # every lane held: it waits
    release.set()
    for thread in [*holders, waiter]:
        thread.join(timeout=60)
    assert errors == [] and third_done.is_set()
    lanes = caller_lanes_of(tenant.pk)
    assert set(lanes) == {0, 2}
    assert sorted(row.caller for rows in lanes.values() for row in rows) == ["one", "third", "two"]
    for lane, lane_rows in lanes.items():
        assert_unbroken(lane_rows, chain=tenant.pk, lane=lane)
    assert audit_chain_breaks() == []


@postgres_only
@transactional
def test_auditing_before_driving_a_run_does_not_deadlock_with_its_driver(make_run):
    """One transaction audits about a run and then locks it (an expiry
    does); another locks the run and then audits (every transition does).
    The writer takes the run's lock before the chain's head, so the second
    waits for the first instead of each holding what the other wants."""
    from django.db import connections

    from runs.transitions import lock_run

    run = make_run("AWAITING_HITL")
    audited = threading.Event()
    errors: list[BaseException] = []

    def audit_then_lock() -> None:
        try:
            with transaction.atomic():
                audit("hitl_timeout", run_id=run.pk, tenant_id=run.tenant_id, caller="expiry")
                audited.set()
                time.sleep(0.5)  # the driver has asked for the run's lock by now
                lock_run(run.pk)
        except BaseException as exc:
            errors.append(exc)
        finally:
            audited.set()
            connections.close_all()

    def lock_then_audit() -> None:
        try:
            audited.wait(timeout=30)
            with transaction.atomic():
                lock_run(run.pk)
                audit("state_changed", run_id=run.pk, tenant_id=run.tenant_id, caller="driver")
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    pool = [threading.Thread(target=audit_then_lock), threading.Thread(target=lock_then_audit)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(timeout=60)

    assert errors == []
    assert [row.caller for row in chain_of(run.tenant_id)] == ["expiry", "driver"]
    assert audit_chain_breaks() == []


# --- the database refuses changes -----------------------------------------------------------------


@pytest.mark.django_db
def test_update_and_delete_are_refused_through_the_orm_and_raw_sql(tenant):
    write(tenant.pk, 2)
    row = chain_of(tenant.pk)[0]
    table = AuditLog._meta.db_table
    attempts = {
        "save": lambda: (setattr(row, "caller", "forged"), row.save()),
        "queryset update": lambda: AuditLog.objects.filter(pk=row.pk).update(caller="forged"),
        "delete": lambda: row.delete(),
        "queryset delete": lambda: AuditLog.objects.all().delete(),
        "raw update": lambda: connection.cursor().execute(f"UPDATE {table} SET caller = 'forged' WHERE id = %s",
                                                          [row.pk]),
        "raw delete": lambda: connection.cursor().execute(f"DELETE FROM {table} WHERE id = %s", [row.pk]),
    }
    refused = {}
    for name, attempt in attempts.items():
        with pytest.raises(DatabaseError) as error, transaction.atomic():
            attempt()
        refused[name] = "append-only" in str(error.value)

    assert refused == dict.fromkeys(attempts, True)
    assert [(r.pk, r.caller) for r in chain_of(tenant.pk)] == [(row.pk, "test 0"), (row.pk + 1, "test 1")]
    assert audit_chain_breaks() == []


@pytest.mark.django_db
def test_a_chain_head_only_moves_forward(tenant):
    """Cutting rows off the end and winding the head back to match is refused too."""
    write(tenant.pk, 3)
    head = AuditChainHead.objects.get(chain=tenant.pk, lane=0)
    second = chain_of(tenant.pk)[1]
    attempts = {
        "rewind": lambda: AuditChainHead.objects.filter(pk=head.pk).update(seq=2, last_hash=second.row_hash),
        "rehash": lambda: AuditChainHead.objects.filter(pk=head.pk).update(last_hash="f" * 64),
        "move": lambda: AuditChainHead.objects.filter(pk=head.pk).update(chain=tenant.pk + 1000),
        "lane": lambda: AuditChainHead.objects.filter(pk=head.pk).update(lane=7),
        "delete": lambda: AuditChainHead.objects.filter(pk=head.pk).delete(),
    }
    for name, attempt in attempts.items():
        with pytest.raises(DatabaseError, match="only moves forward"), transaction.atomic():
            attempt()

    assert AuditChainHead.objects.filter(pk=head.pk).values_list("chain", "seq", "last_hash").get() == (
        tenant.pk, 3, chain_of(tenant.pk)[2].row_hash)
    write(tenant.pk, 1)
    assert_unbroken(chain_of(tenant.pk), chain=tenant.pk)


@pytest.mark.django_db
def test_a_head_moved_ahead_of_its_rows_is_reported(tenant):
    """A head may move by several links at once (a transaction's rows are
    appended together), so the database lets it skip ahead; the verifier
    then finds rows missing at the end."""
    write(tenant.pk, 2)
    AuditChainHead.objects.filter(chain=tenant.pk, lane=0).update(seq=9)

    [found] = audit_chain_breaks()
    assert found.startswith(f"audit chain of tenant {tenant.pk} (lane 0) broken after row {chain_of(tenant.pk)[1].pk} "
                            "(seq 2): the head is at seq 9 ")
    assert found.endswith("(rows at the end are missing)")


@pytest.mark.django_db
def test_rows_held_to_the_end_of_a_transaction_are_chained_in_the_order_recorded(tenant):
    """Inside ``recorded_at_the_end`` the rows are appended together at its
    end: the head moves once, by all of them, and the chain is unbroken."""
    write(tenant.pk, 1)
    with transaction.atomic(), recorded_at_the_end():
        for index in range(3):
            audit(AuditEvent.STATE_CHANGED, run_id=None, tenant_id=tenant.pk, caller=f"held {index}")
        assert len(chain_of(tenant.pk)) == 1  # nothing written before the end
    write(tenant.pk, 1)

    rows = chain_of(tenant.pk)
    assert [row.caller for row in rows] == ["test 0", "held 0", "held 1", "held 2", "test 0"]
    assert [row.created_at for row in rows[1:4]] == sorted(row.created_at for row in rows[1:4])
    assert_unbroken(rows, chain=tenant.pk)
    assert audit_chain_breaks() == []


@pytest.mark.django_db
def test_rows_held_by_a_block_that_fails_are_never_written(tenant):
    with pytest.raises(RuntimeError), transaction.atomic(), recorded_at_the_end():
        audit(AuditEvent.STATE_CHANGED, run_id=None, tenant_id=tenant.pk, caller="held")
        raise RuntimeError("the block fails")

    assert chain_of(tenant.pk) == []
    assert not AuditChainHead.objects.filter(chain=tenant.pk).exists()


@pytest.mark.skipif(connection.vendor != "sqlite", reason="the SQLite trigger's connection flag")
@transactional
def test_on_sqlite_only_the_flagged_connection_may_delete(tenant):
    write(tenant.pk, 2)
    shell = sqlite3.connect(connection.settings_dict["NAME"])  # the sqlite3 shell: no execgo function
    try:
        with pytest.raises(sqlite3.OperationalError, match="no such function: execgo_audit_erasable"):
            shell.execute("DELETE FROM runs_auditlog")
        with pytest.raises(sqlite3.IntegrityError, match="append-only: UPDATE refused"):
            shell.execute("UPDATE runs_auditlog SET caller = 'forged'")
    finally:
        shell.close()
    assert len(chain_of(tenant.pk)) == 2

    first, second = chain_of(tenant.pk)
    with sqlite_audit_erasable(connection):
        first.delete()
    with pytest.raises(DatabaseError, match="append-only: DELETE refused"):
        second.delete()  # the flag is off again
    assert [row.pk for row in chain_of(tenant.pk)] == [second.pk]


# --- tampering is found and named -----------------------------------------------------------------


def _edit_content(rows):
    bypassing_the_trigger(f"UPDATE {AuditLog._meta.db_table} SET caller = 'someone else' WHERE id = %s",
                          [rows[1].pk])
    return f"broken at row {rows[1].pk} (seq 2, state_changed): its content does not match its row_hash"


def _edit_and_rehash(rows):
    forged = AuditLog.objects.get(pk=rows[1].pk)
    forged.caller = "someone else"
    bypassing_the_trigger(f"UPDATE {AuditLog._meta.db_table} SET caller = %s, row_hash = %s WHERE id = %s",
                          [forged.caller, row_digest(row_content(forged)), forged.pk])
    return f"broken at row {rows[2].pk} (seq 3, state_changed): prev_hash {rows[2].prev_hash[:16]} is not the " \
           f"row_hash of row {rows[1].pk}"


def _delete_middle(rows):
    bypassing_the_trigger(f"DELETE FROM {AuditLog._meta.db_table} WHERE id = %s", [rows[1].pk])
    return f"broken at row {rows[2].pk} (seq 3, state_changed): expected seq 2, rows 2..2 are missing"


def _delete_last(rows):
    bypassing_the_trigger(f"DELETE FROM {AuditLog._meta.db_table} WHERE id = %s", [rows[-1].pk])
    return f"broken after row {rows[-2].pk} (seq 3): the head is at seq 4"


def _insert_forged(rows):
    head = AuditChainHead.objects.get(chain=rows[0].tenant_id, lane=0)
    with connection.cursor() as cursor:  # an INSERT is allowed: only its hash can give it away
        cursor.execute(
            f"INSERT INTO {AuditLog._meta.db_table} (tenant_id, event, caller, forced_by, from_state, to_state, data, "
            "created_at, chain_lane, chain_seq, prev_hash, row_hash) VALUES (%s, 'run_succeeded', 'forger', '', '', "
            "'', '{}', %s, 0, %s, %s, %s)",
            [rows[0].tenant_id, rows[0].created_at, head.seq + 1, head.last_hash, "f" * 64])
    forged = AuditLog.objects.get(chain_seq=head.seq + 1, tenant_id=rows[0].tenant_id)
    return f"broken at row {forged.pk} (seq 5, run_succeeded): its content does not match its row_hash"


@transactional
@pytest.mark.parametrize("tamper", [_edit_content, _edit_and_rehash, _delete_middle, _delete_last, _insert_forged],
                         ids=["edit", "edit-and-rehash", "delete-middle", "delete-last", "insert-forged"])
def test_execgo_reconcile_names_the_first_broken_row(tenant, tamper):
    write(tenant.pk, 4)
    assert find_violations() == []  # the command's clean answer is test_reconcile.py's

    expected = tamper(chain_of(tenant.pk))
    result = manage("execgo_reconcile")

    assert result.returncode == 1, result.stdout + result.stderr
    violations = [line for line in result.stdout.splitlines() if "audit chain" in line]
    assert len(violations) == 1, result.stdout
    assert violations[0].startswith(f"VIOLATION: audit chain of tenant {tenant.pk} (lane 0) {expected}"), violations


@postgres_only
@transactional
@pytest.mark.parametrize("tamper", ["delete-middle", "move-to-lane-0"])
def test_a_row_tampered_in_another_lane_is_named_too(tenant, tamper):
    """While a transaction holds lane 0, the tenant's other writers chain in
    lane 2: a row removed there, or moved to lane 0, is found like any."""
    from django.db import connections

    holding, release = threading.Event(), threading.Event()

    def holder() -> None:
        try:
            with transaction.atomic():
                write_as("holder", tenant.pk, 1)
                holding.set()
                release.wait(timeout=30)
        finally:
            holding.set()
            connections.close_all()

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert holding.wait(timeout=30)
        write(tenant.pk, 4)  # four transactions of their own, lane 0 held meanwhile
    finally:
        release.set()
        thread.join(timeout=30)
    rows = chain_of(tenant.pk, lane=2)
    assert len(rows) == 4 and [row.caller for row in chain_of(tenant.pk)] == ["holder"]
    assert audit_chain_breaks() == []

    if tamper == "delete-middle":
        bypassing_the_trigger(f"DELETE FROM {AuditLog._meta.db_table} WHERE id = %s", [rows[1].pk])
        expected = [f"audit chain of tenant {tenant.pk} (lane 2) broken at row {rows[2].pk} (seq 3"]
    else:
        bypassing_the_trigger(f"UPDATE {AuditLog._meta.db_table} SET chain_lane = 0, chain_seq = 2 WHERE id = %s",
                              [rows[3].pk])
        expected = [f"audit chain of tenant {tenant.pk} (lane 0) broken at row {rows[3].pk} (seq 2",
                    f"audit chain of tenant {tenant.pk} (lane 2) broken after row {rows[2].pk} (seq 3)"]
    breaks = audit_chain_breaks()
    assert len(breaks) == len(expected), breaks
    for found, wanted in zip(sorted(breaks), sorted(expected)):
        assert found.startswith(wanted), breaks


# --- the export, verified offline -----------------------------------------------------------------


@transactional
def test_the_export_verifies_offline_and_a_tampered_line_does_not(tenant, other_tenant, tmp_path):
    write(tenant.pk, 4)
    write(other_tenant.pk, 2)
    if connection.vendor == "postgresql":
        with transaction.atomic():
            audit("invalid_transition", run_id=None, tenant_id=tenant.pk, caller="kept", independently=True,
                  data={"why": "lane 1"})
    export = tmp_path / "audit.jsonl"

    done = manage("execgo_audit_export", "--tenant", tenant.name, "--output", str(export))
    assert done.returncode == 0, done.stderr
    lines = export.read_text().splitlines()
    rows = len(chain_of(tenant.pk)) + len(chain_of(tenant.pk, lane=1))
    assert len(lines) == rows and done.stderr.strip() == f"exported {rows} audit rows of tenant {tenant.pk} (acme)"
    assert {json.loads(line)["tenant"] for line in lines} == {tenant.pk}
    by_id = manage("execgo_audit_export", "--tenant", str(tenant.pk))
    assert by_id.stdout.splitlines() == lines

    ok = verify_offline(export)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.startswith(f"OK: {rows} rows of tenant {tenant.pk}; lane 0 head seq 4 row_hash ")
    anchor = re.search(r"--anchor (0:4:[0-9a-f]{64})", ok.stdout).group(1)
    assert verify_offline(export, "--anchor", anchor).returncode == 0
    # The log grows: a later export still holds the anchor.
    write(tenant.pk, 1)
    later = tmp_path / "later.jsonl"
    assert manage("execgo_audit_export", "--tenant", tenant.name, "--output", str(later)).returncode == 0
    assert verify_offline(later, "--anchor", anchor).returncode == 0
    wrong = anchor[:-1] + ("1" if anchor.endswith("0") else "0")  # one hex digit off (never the same digit)
    assert verify_offline(later, "--anchor", wrong).stdout.startswith("BROKEN: lane 0 seq 4 has row_hash")

    def tampered(name: str, new_lines: list[str]) -> subprocess.CompletedProcess:
        path = tmp_path / name
        path.write_text("\n".join(new_lines) + "\n")
        return verify_offline(path, "--anchor", anchor)

    edited = json.loads(lines[2])
    edited["data"]["index"] = 99
    cases = {
        "edited": tampered("edited", lines[:2] + [json.dumps(edited)] + lines[3:]),
        "dropped": tampered("dropped", lines[:1] + lines[2:]),
        "swapped": tampered("swapped", [lines[1], lines[0]] + lines[2:]),
        "cut": tampered("cut", [line for line in lines if json.loads(line)["seq"] < 4 or json.loads(line)["lane"]]),
    }
    assert {name: result.returncode for name, result in cases.items()} == dict.fromkeys(cases, 1)
    assert cases["edited"].stdout.startswith("BROKEN: line 3 (row ")
    assert "its content does not match its row_hash" in cases["edited"].stdout
    assert "line 2" in cases["dropped"].stdout and "expected seq 2" in cases["dropped"].stdout
    assert cases["swapped"].stdout.startswith("BROKEN: line 1") and "expected seq 1" in cases["swapped"].stdout
    assert cases["cut"].stdout.startswith("BROKEN: lane 0 ends at seq 3, before the anchor at seq 4")


@transactional
def test_export_of_an_unknown_tenant_fails(tenant):
    result = manage("execgo_audit_export", "--tenant", "no-such-tenant")

    assert result.returncode == 1
    assert "no tenant 'no-such-tenant'" in result.stderr


# --- one writer -----------------------------------------------------------------------------------


def test_nothing_but_the_audit_writer_creates_audit_rows():
    pattern = re.compile(r"(?<!class )\bAuditLog\s*\(|AuditLog\.objects\.(create|bulk_create|get_or_create|update_or_create)|"
                         r"insert\(\s*\[\s*AuditLog")
    offenders = []
    for package in ("runs", "approvals", "runtime", "execgo"):
        for path in (ROOT / package).rglob("*.py"):
            relative = path.relative_to(ROOT).as_posix()
            if relative in {"runs/audit.py"} or "/migrations/" in relative:
                continue
            if pattern.search(path.read_text()):
                offenders.append(relative)
    assert offenders == []


@pytest.mark.django_db
def test_tenants_are_chained_apart_from_their_names(tenant):
    """A tenant renamed keeps its chain: the chain names the tenant by id."""
    write(tenant.pk, 2)
    Tenant.objects.filter(pk=tenant.pk).update(name="renamed")

    assert audit_chain_breaks() == []
