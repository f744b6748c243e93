"""The audit log is tamper-evident: UPDATE and DELETE refused by the
database, a chain head that only moves forward, tampering found by
execgo_reconcile (which names the first broken row) and, exported, by a
standard-library script."""

import json
import re
import sqlite3
import subprocess
import threading

import pytest
from django.db import DatabaseError, connection, transaction

from runs.audit import audit, sqlite_audit_erasable
from runs.audit_hash import row_content, row_digest
from runs.invariants import audit_chain_breaks, find_violations
from runs.models import AuditChainHead, AuditEvent, AuditLog
from runs.transitions import recorded_at_the_end
from tests.conftest import postgres_only
from tests.runs.audit_rows import (
    assert_unbroken,
    bypassing_the_trigger,
    chain_of,
    manage,
    transactional,
    verify_offline,
    write,
    write_as,
)

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
