"""A step's two-layer lifecycle is data (``runs.step_lifecycle``): the table
is consistent with StepStatus and StepRunStatus, is the one
docs/state-machine.md#steps documents, and is exactly what the code does
(every call site's moves are in it, and each of its moves is made by one).
``step_set`` is a compare-and-set: a lost race returns False and writes
nothing; a status written any other way by the application is refused."""

import ast
from collections import deque
from pathlib import Path

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runs.models import Step, StepRunStatus, StepStatus
from runs.step_lifecycle import (
    ATTEMPT_ENDS,
    FINAL_STATUSES,
    INITIAL,
    MOVES,
    NO_ATTEMPT,
    RUN_STATUS_TRANSITIONS,
    STATUS_TRANSITIONS,
    InvalidStepTransition,
    placing_steps,
    step_set,
)
from runtime import statements

ROOT = Path(__file__).resolve().parents[2]

# docs/state-machine.md#steps, written out by hand (as test_transition_table
# does for runs): the module may not drift from the documented table.
EXPECTED_MOVES = {
    (("pending", ""), ("pending", "accepted")): True,
    (("pending", ""), ("running", "running")): True,
    (("pending", ""), ("skipped", "")): False,
    (("pending", "accepted"), ("running", "running")): False,
    (("running", "accepted"), ("running", "running")): False,
    (("pending", "accepted"), ("failed", "cancelled")): False,
    (("running", "accepted"), ("failed", "cancelled")): False,
    (("running", "running"), ("success", "success")): False,
    (("running", "running"), ("failed", "failed")): False,
    (("running", "running"), ("failed", "cancelled")): False,
    (("running", "running"), ("running", "failed")): False,
    (("running", "failed"), ("running", "accepted")): True,
}  # move → whether it opens an attempt

STATUSES = [status.value for status in StepStatus]
RUN_STATUSES = [NO_ATTEMPT, *(status.value for status in StepRunStatus)]
PAIRS = [(status, run_status) for status in STATUSES for run_status in RUN_STATUSES]


def reachable(edges, start) -> set:
    seen, queue = {start}, deque([start])
    while queue:
        here = queue.popleft()
        for source, target in edges:
            if source == here and target not in seen:
                seen.add(target)
                queue.append(target)
    return seen


def test_the_module_table_is_the_spec_table():
    declared = {(move.source, move.target): move.opens_attempt for move in MOVES}
    assert len(declared) == len(MOVES), "a move is declared twice"
    assert declared == EXPECTED_MOVES
    assert all(move.by for move in MOVES)


def test_each_layer_is_the_projection_of_the_moves():
    assert STATUS_TRANSITIONS == {
        ("pending", "running"), ("pending", "skipped"), ("pending", "failed"),
        ("running", "success"), ("running", "failed"),
    }
    assert RUN_STATUS_TRANSITIONS == {
        ("", "accepted"), ("", "running"), ("accepted", "running"), ("accepted", "cancelled"),
        ("running", "success"), ("running", "failed"), ("running", "cancelled"), ("failed", "accepted"),
    }


def test_every_state_of_either_layer_is_reachable_and_only_finals_are_dead_ends():
    assert INITIAL == ("pending", "")
    assert reachable(STATUS_TRANSITIONS, "pending") == set(STATUSES)
    assert reachable(RUN_STATUS_TRANSITIONS, "") == set(RUN_STATUSES)
    pairs = {move.source for move in MOVES} | {move.target for move in MOVES}
    assert reachable({(move.source, move.target) for move in MOVES}, INITIAL) == pairs
    assert {status for status in STATUSES if not any(source == status for source, _ in STATUS_TRANSITIONS)} \
        == set(FINAL_STATUSES)
    # A pair is a dead end exactly when its status is final.
    assert {pair for pair in pairs if not any(move.source == pair for move in MOVES)} \
        == {pair for pair in pairs if pair[0] in FINAL_STATUSES}


def test_finals_have_no_exits_and_an_ended_attempt_is_left_only_for_the_next():
    assert not [move for move in MOVES if move.source[0] in FINAL_STATUSES]
    assert ATTEMPT_ENDS == {"success", "failed", "cancelled"}
    for move in MOVES:
        if move.source[1] in ATTEMPT_ENDS:
            assert move.opens_attempt, move
    # Success and cancelled end the step's attempts for good.
    assert not [move for move in MOVES if move.source[1] in {"success", "cancelled"}]


def doc_rows(heading: str) -> list[list[str]]:
    section = (ROOT / "docs" / "state-machine.md").read_text().split("\n## Steps\n", 1)[1].split("\n## ", 1)[0]
    table = section.split(f"\n### {heading}\n", 1)[1].split("\n### ", 1)[0]
    rows = [[cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
            for line in table.splitlines() if line.startswith("|")]
    return [[cell.replace('""', "") for cell in row] for row in rows[2:]]  # header and |---| left out


def test_the_documented_tables_are_the_module_tables():
    moves = {((row[0], row[1]), (row[2], row[3])): row[4] == "yes" for row in doc_rows("Moves")}
    assert moves == {(move.source, move.target): move.opens_attempt for move in MOVES}
    assert {(row[0], row[1]) for row in doc_rows("The status layer")} == STATUS_TRANSITIONS
    assert {(row[0], row[1]) for row in doc_rows("The run_status layer")} == RUN_STATUS_TRANSITIONS


# --- step_set, the compare-and-set ---------------------------------------------

def place(step: Step, pair: tuple[str, str], *, attempt: int = 1) -> Step:
    """Test factory: put ``step`` in ``pair`` directly."""
    Step.objects.filter(pk=step.pk).update(status=pair[0], run_status=pair[1], attempt=attempt, handle_id="h-placed")
    return Step.objects.get(pk=step.pk)


@pytest.fixture
def step(make_run):
    run = make_run("EXECUTING")
    return Step.objects.create(run=run, step_id="a", position=0, tool="shell", params={"argv": ["true"]},
                               timeout_s=5)


def row(step: Step) -> dict:
    return Step.objects.filter(pk=step.pk).values().get()


@pytest.mark.django_db
def test_a_won_move_writes_both_layers_and_its_fields_in_one_update(step):
    now = timezone.now()
    with CaptureQueriesContext(connection) as captured:
        won = step_set(step, expect=("pending", ""), to=("running", "running"), attempt=1, handle_id="h-1",
                       host="here", started_at=now)

    assert won is True
    assert [query["sql"].split()[0] for query in captured.captured_queries] == ["UPDATE"]
    stored = row(step)
    assert (stored["status"], stored["run_status"], stored["attempt"], stored["handle_id"], stored["host"]) == (
        "running", "running", 1, "h-1", "here")
    assert (step.status, step.run_status, step.attempt, step.handle_id, step.started_at) == (
        "running", "running", 1, "h-1", now)


@pytest.mark.django_db
def test_a_lost_move_returns_false_and_writes_nothing(step):
    step = place(step, ("running", "running"), attempt=2)
    before = row(step)

    # Another writer moved it since this copy was read …
    stale = Step.objects.get(pk=step.pk)
    stale.status, stale.run_status = "pending", ""
    assert step_set(stale, expect=("pending", ""), to=("pending", "accepted"), attempt=1, handle_id="h-x") is False
    # … or the fence names an attempt that was superseded.
    assert step_set(step, expect=("running", "running"), to=("success", "success"), where={"attempt": 1},
                    result={"status": "success"}, finished_at=timezone.now()) is False

    assert row(step) == before
    assert (stale.status, stale.run_status, stale.attempt) == ("pending", "", 2)
    assert (step.status, step.result) == ("running", None)


@pytest.mark.django_db
def test_a_move_not_in_the_table_is_refused_before_anything_is_written(step):
    before = row(step)
    for to in [("success", "success"), ("running", "accepted"), ("skipped", "accepted"), ("failed", "")]:
        with pytest.raises(InvalidStepTransition):
            step_set(step, expect=("pending", ""), to=to)
    with pytest.raises(InvalidStepTransition, match="must write the attempt"):
        step_set(step, expect=("pending", ""), to=("pending", "accepted"), handle_id="h-1")
    with pytest.raises(InvalidStepTransition, match="may not write the attempt"):
        step_set(step, expect=("pending", ""), to=("skipped", ""), attempt=3)
    assert row(step) == before


@pytest.mark.django_db
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stored=st.sampled_from(PAIRS), expect=st.sampled_from(PAIRS), to=st.sampled_from(PAIRS))
def test_step_set_moves_a_step_exactly_when_the_move_is_declared_and_the_row_holds_what_is_expected(
        step, stored, expect, to):
    step = place(step, stored, attempt=1)
    declared = {(move.source, move.target): move for move in MOVES}.get((expect, to))
    fields = {"attempt": 2, "handle_id": "h-next"} if declared is not None and declared.opens_attempt else {}

    if declared is None:
        with pytest.raises(InvalidStepTransition):
            step_set(step, expect=expect, to=to, **fields)
        assert (row(step)["status"], row(step)["run_status"]) == stored
        return
    won = step_set(step, expect=expect, to=to, **fields)

    assert won is (stored == expect)
    after = row(step)
    assert (after["status"], after["run_status"]) == (to if won else stored)
    assert after["attempt"] == (2 if won and fields else 1)


# --- the guard -------------------------------------------------------------------

def as_the_kernel(source: str, **names) -> None:
    """Run ``source`` as application code does: outside ``placing_steps``
    (these tests are marked ``step_guard``, so the suite's own factories'
    leave does not apply)."""
    exec(compile(source, str(ROOT / "runs" / "somewhere.py"), "exec"), {"__name__": "runs.somewhere", **names})


WRITES = [
    "Step.objects.filter(pk=pk).update(status='failed')",
    "Step.objects.filter(pk=pk).update(run_status='accepted', attempt=1)",
    "step = Step.objects.get(pk=pk); step.status = 'skipped'; step.save()",
    "step = Step.objects.get(pk=pk); step.run_status = 'running'; step.save(update_fields=['run_status'])",
    "statements.update(Step, {'id': pk}, {'run_status': 'running'})",
    "Step.objects.create(run_id=run_id, step_id='b', position=1, tool='shell', params={}, timeout_s=5,"
    " status='success')",
]


@pytest.mark.django_db
@pytest.mark.step_guard
@pytest.mark.parametrize("write", WRITES)
def test_a_status_written_outside_step_set_by_the_application_is_refused(step, write):
    before = row(step)

    with pytest.raises(InvalidStepTransition, match="step_set only"):
        as_the_kernel(write, Step=Step, statements=statements, pk=step.pk, run_id=step.run_id)

    assert row(step) == before
    assert Step.objects.filter(run_id=step.run_id).count() == 1


@pytest.mark.django_db
@pytest.mark.step_guard
@pytest.mark.parametrize("write", WRITES)
def test_only_placing_steps_lets_a_status_be_written_directly(step, write):
    """The leave the suite's factories and the benchmarks take, and only
    they: nothing of the application enters ``placing_steps``."""
    before = row(step)

    with placing_steps():
        as_the_kernel(write, Step=Step, statements=statements, pk=step.pk, run_id=step.run_id)

    assert row(step) != before or Step.objects.filter(run_id=step.run_id).count() == 2


@pytest.mark.django_db
@pytest.mark.step_guard
def test_the_application_writes_a_step_freely_but_for_its_status(step):
    as_the_kernel("Step.objects.filter(pk=pk).update(progress=40)\n"
                  "statements.update(Step, {'id': pk}, {'host': 'elsewhere'})\n"
                  "step = Step.objects.get(pk=pk); step.params = {'argv': ['false']}; step.save()\n"
                  "Step.objects.create(run_id=run_id, step_id='b', position=1, tool='shell', params={}, timeout_s=5)",
                  Step=Step, statements=statements, pk=step.pk, run_id=step.run_id)

    stored = row(step)
    assert (stored["progress"], stored["host"], stored["params"]) == (40, "elsewhere", {"argv": ["false"]})
    assert (stored["status"], stored["run_status"]) == INITIAL
    assert Step.objects.get(run_id=step.run_id, step_id="b").status == "pending"


def direct_status_writes(source: str) -> list[int]:
    """Lines of ``source`` that write a step's status layer other than
    through ``step_set``: a compiled UPDATE of ``Step``, or an update of a
    queryset of steps (``Step.…`` or ``….steps``) naming a status layer, or
    with keywords it cannot see (``**values``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        receiver, chain = node.func.value, []
        while isinstance(receiver, (ast.Attribute, ast.Call)):
            if isinstance(receiver, ast.Attribute):
                chain.append(receiver.attr)
                receiver = receiver.value
            else:
                receiver = receiver.func
        root = receiver.id if isinstance(receiver, ast.Name) else ""
        if root == "statements" and node.func.attr == "update":
            if node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "Step":
                found.append(node.lineno)
        elif node.func.attr in ("update", "bulk_update") and (root == "Step" or "steps" in chain):
            written = {keyword.arg for keyword in node.keywords}
            listed = {element.value for arg in node.args[1:] if isinstance(arg, (ast.List, ast.Tuple))
                      for element in arg.elts if isinstance(element, ast.Constant)}
            if written & {"status", "run_status", None} or listed & {"status", "run_status"}:
                found.append(node.lineno)
    return found


def test_the_application_writes_a_status_layer_only_through_step_set():
    """What the guard refuses at run time, found in the source: no module
    of the apps writes a step's status layer but through ``step_set``."""
    offenders = [f"{path.relative_to(ROOT)}:{line}"
                 for app in ("runs", "approvals", "runtime", "execgo") for path in sorted((ROOT / app).rglob("*.py"))
                 if "migrations" not in path.parts and path.name != "step_lifecycle.py"
                 for line in direct_status_writes(path.read_text())]
    assert offenders == []
    assert direct_status_writes("Step.objects.filter(pk=1).update(status='failed')\n"
                                "run.steps.update(**values)\n"
                                "statements.update(Step, where, values)\n"
                                "Step.objects.filter(pk=1).update(progress=3)\n") == [1, 2, 3]
