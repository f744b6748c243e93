"""Single-table statements compiled once: the few a sequential chain runs
between every two of its steps.

The ORM builds a queryset's SQL anew on every call, which costs about as much
on a small CPU as PostgreSQL takes to run the statement; a chain pays it
five times a step. These helpers keep the SQL per model and column list, and
adapt every value with the model field's own ``get_db_prep_save``, so the rows
they write are the ones the ORM writes, on PostgreSQL and on SQLite. Filters
are equalities only; anything richer goes through the ORM.
"""

from functools import lru_cache

from django.db import connection
from django.db.models import Model


def update(model: type[Model], where: dict, values: dict) -> int:
    """``model.objects.filter(**where).update(**values)``: the number of
    rows changed. ``where`` values may not be None (no IS NULL here)."""
    if any(value is None for value in where.values()):
        raise ValueError("statements.update filters on equality only; None needs the ORM")
    sql = _update_sql(model, tuple(values), tuple(where), connection.vendor)
    params = _prepared(model, values) + _prepared(model, where)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount


def insert(objs: list[Model]) -> None:
    """``bulk_create(objs)`` for new rows of one model whose primary keys the
    caller never reads (they are not set on ``objs``)."""
    if not objs:
        return
    model = type(objs[0])
    fields = _insert_fields(model)
    batch = connection.ops.bulk_batch_size(fields, objs) or len(objs)
    with connection.cursor() as cursor:
        for start in range(0, len(objs), batch):
            chunk = objs[start:start + batch]
            params = [field.get_db_prep_save(field.pre_save(obj, True), connection=connection)
                      for obj in chunk for field in fields]
            cursor.execute(_insert_sql(model, len(chunk), connection.vendor), params)


def select_for_update(model: type[Model], pk, fields: tuple[str, ...]) -> Model | None:
    """``model.objects.select_for_update().only(*fields).filter(pk=pk).first()``
    (a plain read where the database has no row locks: SQLite serialises
    writers instead)."""
    sql = _select_sql(model, fields, connection.vendor, connection.features.has_select_for_update)
    return next(iter(model.objects.raw(sql, [pk])), None)


def _prepared(model: type[Model], values: dict) -> list:
    meta = model._meta
    return [meta.get_field(name).get_db_prep_save(value, connection=connection) for name, value in values.items()]


def _columns(model: type[Model], names: tuple[str, ...]) -> list[str]:
    return [connection.ops.quote_name(model._meta.get_field(name).column) for name in names]


def _table(model: type[Model]) -> str:
    return connection.ops.quote_name(model._meta.db_table)


# ``vendor`` is part of each key: a process that switches databases (tests)
# never reuses another backend's quoting.
@lru_cache(maxsize=None)
def _update_sql(model: type[Model], set_names: tuple[str, ...], where_names: tuple[str, ...], vendor: str) -> str:
    assignments = ", ".join(f"{column} = %s" for column in _columns(model, set_names))
    conditions = " AND ".join(f"{column} = %s" for column in _columns(model, where_names))
    return f"UPDATE {_table(model)} SET {assignments} WHERE {conditions}"


@lru_cache(maxsize=None)
def _insert_fields(model: type[Model]) -> list:
    return [field for field in model._meta.concrete_fields if not field.primary_key]


@lru_cache(maxsize=None)
def _insert_sql(model: type[Model], rows: int, vendor: str) -> str:
    fields = _insert_fields(model)
    columns = ", ".join(connection.ops.quote_name(field.column) for field in fields)
    row = "(" + ", ".join(["%s"] * len(fields)) + ")"
    return f"INSERT INTO {_table(model)} ({columns}) VALUES {', '.join([row] * rows)}"


@lru_cache(maxsize=None)
def _select_sql(model: type[Model], names: tuple[str, ...], vendor: str, for_update: bool) -> str:
    pk = connection.ops.quote_name(model._meta.pk.column)
    sql = f"SELECT {', '.join(_columns(model, names))} FROM {_table(model)} WHERE {pk} = %s"
    return f"{sql} FOR UPDATE" if for_update else sql
