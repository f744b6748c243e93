"""Single-table statements compiled once: the few a sequential chain runs
between every two of its steps, and several such writes sent as one
statement (``write_together``).

The ORM builds a queryset's SQL anew on every call, which costs about as much
on a small CPU as PostgreSQL takes to run the statement; a chain pays it
five times a step. These helpers keep the SQL per model and column list, and
adapt every value with the model field's own ``get_db_prep_save``, so the rows
they write are the ones the ORM writes, on PostgreSQL and on SQLite, on the
connection ``using`` names. Filters are equalities only; anything richer goes
through the ORM.

Writing raw SQL skips the model's own guards, so what would get past one is
refused with a ValueError when the statement is first compiled (the hot path
pays nothing):

- a django-fsm state field, set by ``update`` or by ``insert`` (a model that
  has one at all): a state is written only by its transition service, under
  its optimistic lock, together with what records the transition (for a run:
  its trace, event and audit row), and that service says so
  (``update``'s ``transition``);
- a field whose ``pre_save`` is not one of Django's own (a FileField's, say)
  among ``update``'s values: it would not run;
- a field the model says has one writer (``WRITER_ONLY_FIELDS``) among
  ``update``'s values, when the model's ``refuse_direct_write`` says that
  writer is not the one writing (a step's two status layers); asked on
  every call, since the same statement is the writer's own.

``update`` does what ``save()`` would for ``auto_now`` fields left out of its
values: it stamps them with their ``pre_save`` (a value given explicitly wins).
``insert`` runs every field's ``pre_save`` as ``bulk_create`` does.
"""

from contextlib import AbstractContextManager, nullcontext
from functools import lru_cache
from types import SimpleNamespace

from django.db import connections, transaction
from django.db.models import DateField, DateTimeField, Field, Model, TimeField
from django_fsm import FSMFieldMixin

# The pre_save methods known to depend on nothing but the field (and, with
# auto_now, the clock): an update may skip or stand in for them.
_PLAIN_PRE_SAVES = {Field.pre_save, DateField.pre_save, DateTimeField.pre_save, TimeField.pre_save}


def update(model: type[Model], where: dict, values: dict, *, using: str = "default", transition: bool = False) -> int:
    """``model.objects.filter(**where).update(**values)``, plus the
    ``auto_now`` stamps ``save()`` would write: the number of rows changed.
    ``where`` values may not be None (no IS NULL here). ``transition``: the
    caller is the transition service of the model's django-fsm state, which
    may write it (``runs.transitions``: filtered on the state it read, with
    what records the transition)."""
    connection = connections[using]
    sql, params = _update_statement(model, where, values, connection, using, transition=transition)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount


def _update_statement(model: type[Model], where: dict, values: dict, connection, using: str, *,
                      transition: bool = False) -> tuple[str, list]:
    if any(value is None for value in where.values()):
        raise ValueError("statements.update filters on equality only; None needs the ORM")
    sql, stamped, guarded = _update_sql(model, tuple(values), tuple(where), connection.vendor, using, transition)
    if guarded:
        model.refuse_direct_write(values)
    # Django's own date/time pre_save only stores its stamp on the instance:
    # a blank object stands in for the row the UPDATE never loads.
    row = SimpleNamespace()
    params = (_prepared(model, values, connection)
              + [field.get_db_prep_save(field.pre_save(row, False), connection=connection) for field in stamped]
              + _prepared(model, where, connection))
    return sql, params


def insert(objs: list[Model], *, using: str = "default") -> None:
    """``bulk_create(objs)`` for new rows of one model whose primary keys the
    caller never reads (they are not set on ``objs``)."""
    if not objs:
        return
    connection = connections[using]
    model = type(objs[0])
    fields = _insert_fields(model)
    batch = connection.ops.bulk_batch_size(fields, objs) or len(objs)
    with connection.cursor() as cursor:
        for start in range(0, len(objs), batch):
            chunk = objs[start:start + batch]
            params = [field.get_db_prep_save(field.pre_save(obj, True), connection=connection)
                      for obj in chunk for field in fields]
            cursor.execute(_insert_sql(model, len(chunk), connection.vendor, using), params)


def select(model: type[Model], pk, fields: tuple[str, ...], *, using: str = "default") -> Model | None:
    """``model.objects.only(*fields).filter(pk=pk).first()``."""
    connection = connections[using]
    sql = _select_sql(model, fields, connection.vendor, using, False)
    return next(iter(model.objects.using(using).raw(sql, [pk])), None)


def select_for_update(model: type[Model], pk, fields: tuple[str, ...], *, using: str = "default") -> Model | None:
    """``model.objects.select_for_update().only(*fields).filter(pk=pk).first()``
    (a plain read where the database has no row locks: SQLite serialises
    writers instead)."""
    connection = connections[using]
    sql = _select_sql(model, fields, connection.vendor, using, connection.features.has_select_for_update)
    return next(iter(model.objects.using(using).raw(sql, [pk])), None)


def write_together(inserts: list[list[Model]], updates: list[tuple[type[Model], dict, dict]], *,
                   using: str = "default") -> None:
    """``insert`` of each list of ``inserts``, then ``update`` of each
    ``(model, where, values)``: one round trip on PostgreSQL (every part but
    the last in a data-modifying WITH), a statement each elsewhere. The
    parts run on one snapshot there, so none may read what another writes
    and no row may be updated twice."""
    connection = connections[using]
    inserts = [objs for objs in inserts if objs]
    if connection.vendor != "postgresql" or len(inserts) + len(updates) < 2 or \
            sum(len(objs) * len(_insert_fields(type(objs[0]))) for objs in inserts) > MAX_PARAMS_TOGETHER:
        for objs in inserts:
            insert(objs, using=using)
        for model, where, values in updates:
            update(model, where, values, using=using)
        return
    parts, params = [], []
    for objs in inserts:
        model = type(objs[0])
        parts.append(_insert_sql(model, len(objs), connection.vendor, using))
        params += [field.get_db_prep_save(field.pre_save(obj, True), connection=connection)
                   for obj in objs for field in _insert_fields(model)]
    for model, where, values in updates:
        sql, update_params = _update_statement(model, where, values, connection, using)
        parts.append(sql)
        params += update_params
    withs = ", ".join(f"w{index} AS ({part})" for index, part in enumerate(parts[:-1]))
    with connection.cursor() as cursor:
        cursor.execute(f"WITH {withs} {parts[-1]}", params)


# Under PostgreSQL's limit of 65,535 parameters a statement, with room to spare.
MAX_PARAMS_TOGETHER = 30_000


def lock_row(model: type[Model], pk, *, using: str = "default") -> None:
    """Lock ``model``'s row ``pk`` for the rest of the transaction, reading
    nothing of it (no instance is built: a django-fsm model would load its
    state to build one). A no-op where the database has no row locks."""
    connection = connections[using]
    if not connection.features.has_select_for_update:
        return
    with connection.cursor() as cursor:
        cursor.execute(_select_sql(model, (model._meta.pk.name,), connection.vendor, using, True), [pk])


def in_transaction(using: str = "default") -> AbstractContextManager:
    """``transaction.atomic()`` when the caller has no transaction; inside
    the caller's, nothing: no savepoint (a SAVEPOINT and a RELEASE, two
    round trips, for every block). For a block whose failure the caller
    never catches and goes on from: it then rolls back with the caller's
    transaction, as it would through its savepoint. A block that raises on
    purpose must raise before it writes, or be given a real savepoint."""
    return nullcontext() if connections[using].in_atomic_block else transaction.atomic(using=using)


def _prepared(model: type[Model], values: dict, connection) -> list:
    meta = model._meta
    return [meta.get_field(name).get_db_prep_save(value, connection=connection) for name, value in values.items()]


def _quote(using: str, name: str) -> str:
    return connections[using].ops.quote_name(name)


def _columns(model: type[Model], names: tuple[str, ...], using: str) -> list[str]:
    return [_quote(using, model._meta.get_field(name).column) for name in names]


def _refuse_state(model: type[Model], field: Field, statement: str) -> None:
    if isinstance(field, FSMFieldMixin):
        raise ValueError(f"statements.{statement} refuses {model.__name__}.{field.name}: a django-fsm state is "
                         "written only by its transition service")


# ``vendor`` is part of each key so two backends never share quoting, even
# when a process points one alias at another database (tests); ``using``
# names the connection that quotes.
@lru_cache(maxsize=None)
def _update_sql(model: type[Model], set_names: tuple[str, ...], where_names: tuple[str, ...], vendor: str,
                using: str, transition: bool = False) -> tuple[str, tuple[Field, ...], bool]:
    """The UPDATE, the ``auto_now`` fields it stamps after ``set_names``, and
    whether it writes a field that has one writer."""
    meta = model._meta
    given = [meta.get_field(name) for name in set_names]
    for field in given:
        if not transition:
            _refuse_state(model, field, "update")
        if type(field).pre_save not in _PLAIN_PRE_SAVES:
            raise ValueError(f"statements.update cannot run the pre_save of {model.__name__}.{field.name}; "
                             "write it through the model's save()")
    stamped = tuple(field for field in meta.concrete_fields if getattr(field, "auto_now", False) and field not in given)
    assignments = ", ".join(f"{column} = %s" for column in
                            _columns(model, set_names, using) + [_quote(using, field.column) for field in stamped])
    conditions = " AND ".join(f"{column} = %s" for column in _columns(model, where_names, using))
    guarded = bool(set(set_names) & set(getattr(model, "WRITER_ONLY_FIELDS", ())))
    return f"UPDATE {_quote(using, meta.db_table)} SET {assignments} WHERE {conditions}", stamped, guarded


@lru_cache(maxsize=None)
def _insert_fields(model: type[Model]) -> list:
    fields = [field for field in model._meta.concrete_fields if not field.primary_key]
    for field in fields:
        _refuse_state(model, field, "insert")
    return fields


@lru_cache(maxsize=None)
def _insert_sql(model: type[Model], rows: int, vendor: str, using: str) -> str:
    fields = _insert_fields(model)
    columns = ", ".join(_quote(using, field.column) for field in fields)
    row = "(" + ", ".join(["%s"] * len(fields)) + ")"
    return f"INSERT INTO {_quote(using, model._meta.db_table)} ({columns}) VALUES {', '.join([row] * rows)}"


@lru_cache(maxsize=None)
def _select_sql(model: type[Model], names: tuple[str, ...], vendor: str, using: str, for_update: bool) -> str:
    pk = _quote(using, model._meta.pk.column)
    sql = f"SELECT {', '.join(_columns(model, names, using))} FROM {_quote(using, model._meta.db_table)} WHERE {pk} = %s"
    return f"{sql} FOR UPDATE" if for_update else sql
