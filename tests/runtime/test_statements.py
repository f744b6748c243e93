"""The precompiled statements write and read exactly what the ORM does, on
both backends: JSON, aware datetimes, foreign keys, the rows matched; stamp
``auto_now`` fields as ``save()`` does; refuse what would bypass a model's
invariants; and run on the connection they are given."""

from datetime import UTC, datetime

import psycopg
import pytest
from django.db import connection, models, transaction
from django.test.utils import isolate_apps
from django.utils import timezone

from runs.models import AuditLog, Event, Job, Run, Step
from runtime import statements
from tests.conftest import ROOT, postgres_only

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


def another_connection() -> psycopg.Connection:
    """A connection of its own to the test database, outside Django's."""
    db = connection.settings_dict
    return psycopg.connect(host=db["HOST"] or "127.0.0.1", port=db["PORT"] or 5432, user=db["USER"] or "postgres",
                           dbname=db["NAME"], autocommit=True)


@postgres_only
def test_select_for_update_holds_the_row_lock_until_commit(make_run):
    run = make_run("EXECUTING")
    with another_connection() as other:
        with transaction.atomic():
            statements.select_for_update(Run, run.pk, ("id", "state"))
            with pytest.raises(psycopg.errors.LockNotAvailable):
                other.execute("SELECT id FROM runs_run WHERE id = %s FOR UPDATE NOWAIT", [run.pk])
        assert other.execute("SELECT id FROM runs_run WHERE id = %s FOR UPDATE NOWAIT", [run.pk]).fetchone() == (run.pk,)


def test_an_insert_and_an_update_written_together_take_one_round_trip_on_postgresql(make_run):
    run = make_run("EXECUTING")
    step = make_step(run)
    event = Event(type="task_progressed", run=run, task_id="a", handle_id="h-1", timestamp=WHEN, data=RESULT)
    sent = []

    def counting(execute, sql, params, many, context):
        sent.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(counting):
        statements.write_together([[event]], [(Step, {"id": step.pk, "attempt": 2},
                                                {"run_status": "success", "result": RESULT})])

    assert len(sent) == (2 if connection.vendor == "sqlite" else 1)
    assert list(Event.objects.filter(run=run, task_id="a").values_list("type", "handle_id", "timestamp", "data")) \
        == [("task_progressed", "h-1", WHEN, RESULT)]
    step.refresh_from_db()
    assert (step.run_status, step.result) == ("success", RESULT)


@postgres_only
def test_lock_row_holds_the_row_lock_until_commit_and_reads_nothing(make_run):
    run = make_run("EXECUTING")
    sent = []

    def counting(execute, sql, params, many, context):
        sent.append(sql)
        return execute(sql, params, many, context)

    with another_connection() as other:
        with transaction.atomic(), connection.execute_wrapper(counting):
            statements.lock_row(Run, run.pk)
            with pytest.raises(psycopg.errors.LockNotAvailable):
                other.execute("SELECT id FROM runs_run WHERE id = %s FOR UPDATE NOWAIT", [run.pk])
        assert len(sent) == 1  # no second query loading the run's state (django-fsm builds instances that way)


def test_update_refuses_the_run_state(make_run):
    run = make_run("EXECUTING")

    with pytest.raises(ValueError, match=r"Run\.state.*transition service"):
        statements.update(Run, {"id": run.pk}, {"previous_state": "PLANNING", "state": "SUCCEEDED"})
    assert Run.objects.filter(pk=run.pk).values_list("state", "previous_state").get() == ("EXECUTING", "")


def test_only_the_run_s_transition_service_says_it_is_one():
    """``update(…, transition=True)`` lets a statement write the state:
    only ``runs.transitions``, under its optimistic lock, says it."""
    apps = ("runs", "policy", "approvals", "pages", "runtime", "execgo", "client")
    saying = sorted(str(path.relative_to(ROOT)) for app in apps for path in (ROOT / app).rglob("*.py")
                    if "transition=True)" in path.read_text())
    assert saying == ["runs/transitions.py"]


def test_insert_refuses_a_run(tenant, agent):
    job = Job.objects.create(tenant=tenant, created_by=agent)
    run = Run(job=job, tenant=tenant, submitted_by=agent, state="SUCCEEDED", timeout_s=1, approval_timeout_s=1,
              last_state_change_at=WHEN)

    with pytest.raises(ValueError, match=r"statements\.insert refuses Run\.state"):
        statements.insert([run])
    assert not Run.objects.exists()


@isolate_apps("runs")
def test_update_refuses_a_field_whose_pre_save_it_cannot_run():
    class Upload(models.Model):
        name = models.CharField(max_length=10)
        file = models.FileField()

        class Meta:
            app_label = "runs"

    with pytest.raises(ValueError, match=r"pre_save of Upload\.file"):
        statements.update(Upload, {"id": 1}, {"file": "a.txt"})


def test_update_stamps_an_auto_now_field_left_out(make_run):
    job = make_run("EXECUTING").job
    Job.objects.filter(pk=job.pk).update(updated_at=datetime(2020, 1, 1, tzinfo=UTC))
    before = timezone.now()

    assert statements.update(Job, {"id": job.pk}, {"title": "x"}) == 1

    job.refresh_from_db()
    assert job.title == "x"
    assert before <= job.updated_at <= timezone.now()


def test_update_keeps_an_auto_now_value_given(make_run):
    job = make_run("EXECUTING").job

    assert statements.update(Job, {"id": job.pk}, {"title": "y", "updated_at": WHEN}) == 1

    job.refresh_from_db()
    assert (job.title, job.updated_at) == ("y", WHEN)


@pytest.mark.django_db(transaction=True, databases=["default", "audit"])
def test_every_statement_runs_on_the_connection_named(make_run):
    run = make_run("EXECUTING", timeout_s=7)
    step = make_step(run)

    assert statements.update(Step, {"id": step.pk, "attempt": 2}, {"run_status": "success"}, using="audit") == 1
    statements.insert([Event(type="task_started", run=run, task_id="a", timestamp=WHEN, data={"via": "audit"})],
                      using="audit")
    loaded = statements.select_for_update(Run, run.pk, ("id", "timeout_s"), using="audit")

    assert Step.objects.get(pk=step.pk).run_status == "success"
    assert list(Event.objects.filter(run=run).values_list("data", flat=True)) == [{"via": "audit"}]
    assert (loaded.timeout_s, loaded._state.db) == (7, "audit")


@postgres_only
@pytest.mark.django_db(transaction=True, databases=["default", "audit"])
def test_an_insert_on_audit_outlives_the_rollback_of_default(make_run):
    run = make_run("EXECUTING")

    with pytest.raises(RuntimeError), transaction.atomic():
        statements.insert([AuditLog(run=run, event="kept", data={"n": 1})], using="audit")
        statements.insert([AuditLog(run=run, event="rolled_back")])
        raise RuntimeError("roll default back")

    assert list(AuditLog.objects.filter(run=run).values_list("event", "data")) == [("kept", {"n": 1})]
