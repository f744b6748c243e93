"""The audit log is a hash chain per tenant, kept unbroken by concurrent
writers in lanes, and written by one writer only. What the database
refuses and how tampering is found: test_audit_tamper.py."""

import re
import threading
import time

import pytest
from django.db import transaction

from runs.audit import audit
from runs.invariants import audit_chain_breaks
from runs.models import AuditLog, Tenant
from tests.conftest import ROOT, postgres_only
from tests.runs.audit_rows import AWKWARD, assert_unbroken, chain_of, transactional, write, write_as

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
