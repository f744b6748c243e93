"""The resource ledger: compare-and-swap reservations, never negative, never over."""

import threading
import time

import pytest
from django.db import IntegrityError, connection, transaction
from django.db.models import F

from runtime import ledger
from runtime.envelopes import EnvelopeError
from runtime.models import HostCapacity, Reservation

pytestmark = pytest.mark.django_db(transaction=True)
MIB = 1024 * 1024


@pytest.fixture
def host(manifest):
    return ledger.host_register("host-a", task_slots=4, memory_bytes=1024 * MIB, pids=100, capabilities=manifest).host


def counters(host):
    row = HostCapacity.objects.get(host=host)
    return row.task_slots_reserved, row.memory_bytes_reserved, row.pids_reserved


def in_threads(count, target):
    errors = []

    def run(index):
        try:
            target(index)
        except BaseException as exc:  # surfaced below: a thread's failure fails the test
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


def test_exactly_capacity_wins_a_race_of_fifty(host):
    winners = []
    in_threads(50, lambda i: winners.append(i) if ledger.reserve(host, f"h-{i}") else None)
    assert len(winners) == 4
    assert counters(host) == (4, 0, 0)
    assert Reservation.objects.count() == 4


def test_twenty_reserves_of_one_handle_at_once_count_it_once(host):
    """A duplicate delivery racing itself: every caller is told the handle
    is reserved, and the counters grew by one reservation (on PostgreSQL the
    losers' inserts do nothing and grow nothing, in the same statement)."""
    answers = []
    in_threads(20, lambda i: answers.append(ledger.reserve(host, "same", memory_bytes=MIB, pids=2)))
    assert answers == [True] * 20
    assert counters(host) == (1, MIB, 2)
    assert list(Reservation.objects.values_list("handle_id", "task_slots", "memory_bytes", "pids")) == [
        ("same", 1, MIB, 2)]
    assert ledger.release("same") is True
    assert counters(host) == (0, 0, 0)


def test_fifty_waiters_on_four_slots_never_overbook_and_all_release(host):
    observed = []

    def step(index):
        waited = ledger.wait_for_reservation(host, f"w-{index}", memory_bytes=10 * MIB, pids=5, timeout_s=120)
        assert waited >= 0
        observed.append(counters(host))
        time.sleep(0.01)
        assert ledger.release(f"w-{index}") is True

    in_threads(50, step)
    assert len(observed) == 50
    assert all(0 < slots <= 4 and 0 < memory <= 40 * MIB and 0 < pids <= 20 for slots, memory, pids in observed)
    assert counters(host) == (0, 0, 0)
    assert Reservation.objects.count() == 0


def test_wait_time_is_recorded(host):
    for i in range(4):
        assert ledger.reserve(host, f"busy-{i}")
    threading.Timer(0.3, lambda: (ledger.release("busy-0"), connection.close())).start()
    waited = ledger.wait_for_reservation(host, "late", timeout_s=10)
    assert waited >= 0.25
    assert Reservation.objects.get(handle_id="late").waited_ms >= 250


def test_wait_gives_up_with_a_retryable_timeout(host):
    for i in range(4):
        ledger.reserve(host, f"busy-{i}")
    with pytest.raises(EnvelopeError) as error:
        ledger.wait_for_reservation(host, "never", timeout_s=0.2)
    assert error.value.envelope["code"] == "timeout"
    assert error.value.envelope["retryable"] is True
    assert counters(host) == (4, 0, 0)


def test_request_larger_than_the_host_is_refused_not_awaited(host):
    with pytest.raises(EnvelopeError) as error:
        ledger.wait_for_reservation(host, "huge", slots=5)
    assert error.value.envelope["code"] == "invalid_input"
    assert not Reservation.objects.filter(handle_id="huge").exists()


def test_release_is_idempotent_and_reserve_too(host):
    assert ledger.reserve(host, "h", slots=2, memory_bytes=MIB, pids=3)
    assert ledger.reserve(host, "h", slots=2, memory_bytes=MIB, pids=3)  # same handle: no double count
    assert counters(host) == (2, MIB, 3)
    assert ledger.release("h") is True
    assert ledger.release("h") is False
    assert counters(host) == (0, 0, 0)


def test_a_release_of_only_mine_leaves_another_process_s_reservation(host):
    ledger.reserve(host, "mine", slots=1, memory_bytes=MIB, pids=2)
    ledger.reserve(host, "theirs", slots=2, memory_bytes=2 * MIB, pids=4)
    Reservation.objects.filter(handle_id="theirs").update(owner_pid=1)  # held by another process
    assert ledger.release("theirs", only_mine=True) is False
    assert ledger.release("mine", only_mine=True) is True
    assert list(Reservation.objects.values_list("handle_id", flat=True)) == ["theirs"]
    assert counters(host) == (2, 2 * MIB, 4)
    assert ledger.release("theirs") is True
    assert counters(host) == (0, 0, 0)


def test_concurrent_releases_give_back_once(host):
    ledger.reserve(host, "twice", slots=3)
    results = []
    in_threads(8, lambda i: results.append(ledger.release("twice")))
    assert results.count(True) == 1
    assert counters(host) == (0, 0, 0)


def test_counters_cannot_go_negative_or_over_even_by_hand(host):
    with pytest.raises(IntegrityError), transaction.atomic():
        HostCapacity.objects.filter(host=host).update(task_slots_reserved=F("task_slots_reserved") - 1)
    with pytest.raises(IntegrityError), transaction.atomic():
        HostCapacity.objects.filter(host=host).update(task_slots_reserved=5)


def test_negative_amounts_are_invalid(host):
    with pytest.raises(EnvelopeError):
        ledger.reserve(host, "neg", slots=-1)


def test_recover_rebuilds_counters_and_drops_dead_steps(host):
    for name in ("alive", "dead"):
        ledger.reserve(host, name, slots=1, memory_bytes=MIB, pids=2)
    HostCapacity.objects.filter(host=host).update(task_slots_reserved=4, pids_reserved=0)  # drifted
    summary = ledger.recover(host, keep=lambda handle_id: handle_id == "alive")
    assert summary["dropped"] == ["dead"]
    assert counters(host) == (1, MIB, 2)
    assert list(Reservation.objects.values_list("handle_id", flat=True)) == ["alive"]


def test_register_keeps_capacity_above_what_is_reserved(host, manifest):
    ledger.reserve(host, "a", slots=3)
    row = ledger.host_register(host, task_slots=1, memory_bytes=MIB, pids=10, capabilities=manifest)
    assert row.task_slots_capacity == 3
    assert row.capabilities["version"] == 1
    assert ledger.available(host)["task_slots"] == 0
