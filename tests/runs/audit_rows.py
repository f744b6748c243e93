"""What the audit log's tests share: rows written through the one writer,
a tenant's chain read back and checked link by link, the management
commands and the offline verifier run as processes, and a write past the
append-only trigger (what the database's owner can do)."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

from runs.audit import audit
from runs.audit_hash import GENESIS, row_content, row_digest
from runs.models import AuditChainHead, AuditLog
from tests.conftest import ROOT, _worker_env

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


def write_as(caller: str, tenant_id: int, count: int) -> None:
    for index in range(count):
        audit("state_changed", run_id=None, tenant_id=tenant_id, caller=caller, data={"index": index})


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
