"""The precompiled statements write and read exactly what the ORM does, on
both backends: JSON, aware datetimes, foreign keys, the rows matched."""

from datetime import UTC, datetime

import psycopg
import pytest
from django.db import connection, transaction

from execgo import statements
from runs.models import Event, Run, Step
from tests.conftest import postgres_only

pytestmark = pytest.mark.django_db(transaction=True)

RESULT = {"status": "success", "output": {"stdout": "žluťoučký ✓\n", "lines": [1, 2.5, None, True]}, "error": None}
WHEN = datetime(2026, 3, 1, 12, 30, 15, 123456, tzinfo=UTC)


def make_step(run: Run, step_id: str = "a") -> Step:
    return Step.objects.create(run=run, step_id=step_id, position=0, tool="shell", params={"argv": ["true"]},
                               timeout_s=5, status="running", run_status="running", attempt=2)


def test_update_writes_what_the_orm_reads_back(make_run):
    step = make_step(make_run("EXECUTING"))

    changed = statements.update(Step, {"id": step.pk, "attempt": 2, "run_status": "running"},
                                {"run_status": "success", "result": RESULT, "finished_at": WHEN, "progress": None})

    assert changed == 1
    step.refresh_from_db()
    assert (step.run_status, step.result, step.finished_at, step.progress) == ("success", RESULT, WHEN, None)


def test_update_changes_nothing_when_the_filter_does_not_match(make_run):
    step = make_step(make_run("EXECUTING"))

    assert statements.update(Step, {"id": step.pk, "attempt": 1}, {"run_status": "success"}) == 0
    assert Step.objects.get(pk=step.pk).run_status == "running"


def test_update_refuses_a_null_filter(make_run):
    step = make_step(make_run("EXECUTING"))

    with pytest.raises(ValueError, match="equality only"):
        statements.update(Step, {"id": step.pk, "host": None}, {"run_status": "success"})
    assert Step.objects.get(pk=step.pk).run_status == "running"


def test_insert_writes_the_rows_bulk_create_writes(make_run):
    run = make_run("EXECUTING")

    def events(tag: str) -> list[Event]:
        return [Event(type="task_started", run=run, task_id=f"{tag}{index}", handle_id="h-1", timestamp=WHEN,
                      message="started", data={"attempt": index, "plan": RESULT}) for index in range(3)]

    Event.objects.bulk_create(events("orm-"))
    statements.insert(events("sql-"))

    fields = ("type", "run_id", "handle_id", "timestamp", "message", "data")
    orm = list(Event.objects.filter(task_id__startswith="orm-").order_by("pk").values_list(*fields))
    sql = list(Event.objects.filter(task_id__startswith="sql-").order_by("pk").values_list(*fields))
    assert sql == orm and len(sql) == 3
    assert list(Event.objects.filter(task_id__startswith="sql-").order_by("pk").values_list("task_id", flat=True)) \
        == ["sql-0", "sql-1", "sql-2"]


def test_insert_splits_what_does_not_fit_one_statement(make_run):
    run = make_run("EXECUTING")
    many = [Event(type="task_progressed", run=run, task_id=f"s{index}", timestamp=WHEN, data={"n": index})
            for index in range(400)]  # 2,800 values: over SQLite's 999 parameters a statement

    statements.insert(many)

    assert list(Event.objects.filter(run=run).order_by("pk").values_list("data", flat=True)) \
        == [{"n": index} for index in range(400)]


def test_select_for_update_loads_the_named_fields_only(make_run):
    run = make_run("EXECUTING", timeout_s=42)

    loaded = statements.select_for_update(Run, run.pk, ("id", "state", "timeout_s", "executing_started_at"))

    assert (loaded.pk, loaded.state, loaded.timeout_s) == (run.pk, "EXECUTING", 42)
    assert loaded.executing_started_at == run.executing_started_at
    assert "plan" in loaded.get_deferred_fields()
    assert statements.select_for_update(Run, run.pk + 1000, ("id", "state")) is None


@postgres_only
def test_select_for_update_holds_the_row_lock_until_commit(make_run):
    run = make_run("EXECUTING")
    db = connection.settings_dict
    other = psycopg.connect(host=db["HOST"] or "127.0.0.1", port=db["PORT"] or 5432, user=db["USER"] or "postgres",
                            dbname=db["NAME"], autocommit=True)
    try:
        with transaction.atomic():
            statements.select_for_update(Run, run.pk, ("id", "state"))
            with pytest.raises(psycopg.errors.LockNotAvailable):
                other.execute("SELECT id FROM runs_run WHERE id = %s FOR UPDATE NOWAIT", [run.pk])
        assert other.execute("SELECT id FROM runs_run WHERE id = %s FOR UPDATE NOWAIT", [run.pk]).fetchone() == (run.pk,)
    finally:
        other.close()
