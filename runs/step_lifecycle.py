"""A step's lifecycle, declared as data, and its one writer
(docs/state-machine.md#steps).

A step has two layers, written together: ``status`` is its place in the
run's DAG, ``run_status`` the state of its current attempt (blank until it
has one)::

    status      pending ──► running ──► success | failed
                   ├──► skipped   (never started)
                   └──► failed    (its queued attempt cancelled)
    run_status  "" ──► accepted ──► running ──► success | failed | cancelled
                 │        └──► cancelled          ▲             │
                 └────────────────────────────────┘ started at once
                          ▲                                     │
                          └──── retry (attempt+1) ◄─────────────┘ failed, retryable

``MOVES`` is every move there is, as a pair of both layers, with who makes
it; ``STATUS_TRANSITIONS`` and ``RUN_STATUS_TRANSITIONS`` are its
projections on each layer. ``step_set`` is the only writer of either layer:
a compare-and-set on both (the UPDATE's WHERE names the pair the caller
expects), refusing a move that is not in ``MOVES``. ``runs.models.Step``
refuses a status written any other way (``refuse_direct_write``).
"""

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from django.db import models

from runtime import statements


class StepStatus(models.TextChoices):
    """Scheduling layer (the step's place in the DAG)."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCESS = "success"
    FAILED = "failed"
    SKIPPED = "skipped"


class StepRunStatus(models.TextChoices):
    """Runtime layer (one real execution): accepted → running → terminal."""

    ACCEPTED = "accepted"
    RUNNING = "running"
    SUCCESS = "success"
    FAILED = "failed"
    CANCELLED = "cancelled"


NO_ATTEMPT = ""  # ``run_status`` of a step that has had no attempt yet
IN_FLIGHT = (StepRunStatus.ACCEPTED, StepRunStatus.RUNNING)

P, R = StepStatus, StepRunStatus


@dataclass(frozen=True)
class Move:
    """One move of a step: from the pair (status, run_status) ``source`` to
    the pair ``target``. ``opens_attempt``: the move starts an attempt (and
    writes its number); no other move writes ``attempt``."""

    source: tuple[str, str]
    target: tuple[str, str]
    by: str
    opens_attempt: bool = False


MOVES: tuple[Move, ...] = (
    Move((P.PENDING, NO_ATTEMPT), (P.PENDING, R.ACCEPTED), "settle: a ready step queued for a worker (attempt 1)",
         opens_attempt=True),
    Move((P.PENDING, NO_ATTEMPT), (P.RUNNING, R.RUNNING), "settle: a ready step started at once by the worker "
         "that settles, its slot held (attempt 1)", opens_attempt=True),
    Move((P.PENDING, NO_ATTEMPT), (P.SKIPPED, NO_ATTEMPT), "settle or close: a step that never started, of a run "
         "cancelled, timed out, with a failed step, or closed"),
    Move((P.PENDING, R.ACCEPTED), (P.RUNNING, R.RUNNING), "a worker's claim of the queued first attempt"),
    Move((P.RUNNING, R.ACCEPTED), (P.RUNNING, R.RUNNING), "a worker's claim of a queued retry"),
    Move((P.PENDING, R.ACCEPTED), (P.FAILED, R.CANCELLED), "settle or close: the queued first attempt cancelled "
         "(run cancelled, timed out or closed)"),
    Move((P.RUNNING, R.ACCEPTED), (P.FAILED, R.CANCELLED), "settle or close: a queued retry cancelled"),
    Move((P.RUNNING, R.RUNNING), (P.SUCCESS, R.SUCCESS), "the attempt's result: succeeded"),
    Move((P.RUNNING, R.RUNNING), (P.FAILED, R.FAILED), "the attempt's result: failed, no retry"),
    Move((P.RUNNING, R.RUNNING), (P.FAILED, R.CANCELLED), "the attempt's result: cancelled; or close: the running "
         "attempt fenced (its late result is audited, not applied)"),
    Move((P.RUNNING, R.RUNNING), (P.RUNNING, R.FAILED), "the attempt's result: failed, a retry follows in the same "
         "transaction"),
    Move((P.RUNNING, R.FAILED), (P.RUNNING, R.ACCEPTED), "the retry: the next attempt queued after its backoff",
         opens_attempt=True),
)

_MOVES = {(move.source, move.target): move for move in MOVES}


def _layer(index: int) -> frozenset[tuple[str, str]]:
    return frozenset((move.source[index], move.target[index]) for move in MOVES
                     if move.source[index] != move.target[index])


STATUS_TRANSITIONS = _layer(0)
RUN_STATUS_TRANSITIONS = _layer(1)
INITIAL = (P.PENDING, NO_ATTEMPT)
# No move leaves these statuses. An attempt that ended (success, failed,
# cancelled) is left only by a move that opens the next attempt.
FINAL_STATUSES = frozenset({P.SUCCESS, P.FAILED, P.SKIPPED})
ATTEMPT_ENDS = frozenset({R.SUCCESS, R.FAILED, R.CANCELLED})
STATUS_FIELDS = ("status", "run_status")


class InvalidStepTransition(Exception):
    pass


def move_for(source: tuple[str, str], target: tuple[str, str]) -> Move:
    move = _MOVES.get((tuple(source), tuple(target)))
    if move is None:
        raise InvalidStepTransition(f"a step does not move from {source} to {target}")
    return move


_writing: ContextVar[bool] = ContextVar("step_status_writer", default=False)


@contextmanager
def _as_the_writer():
    token = _writing.set(True)
    try:
        yield
    finally:
        _writing.reset(token)


def step_set(step, *, expect: tuple[str, str], to: tuple[str, str], where: dict | None = None, **fields) -> bool:
    """Move ``step`` from ``expect`` to ``to`` (each a pair (status,
    run_status)) if its row still holds ``expect`` and matches ``where``
    (the attempt's fence), writing ``fields`` in the same UPDATE; on success
    set what was written on ``step``. Returns whether it won: False when
    another writer moved the step first (nothing is written then).

    One compiled UPDATE (``runtime.statements``): settle and a finishing
    attempt call it between every two steps of a chain."""
    move = move_for(expect, to)
    if move.opens_attempt != ("attempt" in fields):
        raise InvalidStepTransition(f"{expect} → {to} {'must' if move.opens_attempt else 'may not'} write the "
                                    "attempt: only a move that opens an attempt numbers it")
    values = {name: new for name, old, new in zip(STATUS_FIELDS, expect, to) if old != new}
    values.update(fields)
    with _as_the_writer():
        won = statements.update(type(step), {"id": step.pk, **dict(zip(STATUS_FIELDS, expect)), **(where or {})},
                                values)
    if won:
        for name, value in values.items():
            setattr(step, name, value)
    return bool(won)


_placing: ContextVar[bool] = ContextVar("steps_placed_directly", default=False)


@contextmanager
def placing_steps():
    """Within it, steps may be put in any state directly: what the test
    suite's factories and the benchmarks' set-up do to build a run as it
    would be at some point of its life. The application never enters it."""
    token = _placing.set(True)
    try:
        yield
    finally:
        _placing.reset(token)


def refuse_direct_write(fields, *, changed: bool = True) -> None:
    """The guard of ``Step``'s save, its QuerySet's update and the compiled
    UPDATE: a status layer among ``fields`` (and ``changed``) written
    outside ``step_set`` raises, unless within ``placing_steps``."""
    if not changed or _writing.get() or _placing.get() or not any(name in fields for name in STATUS_FIELDS):
        return
    raise InvalidStepTransition("a step's status and run_status are written by runs.step_lifecycle.step_set only")
