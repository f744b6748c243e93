"""The suite's database backends: the project's own (PostgreSQL, SQLite)
with a cheaper way of putting the database back as migrated after a
transactional test.

Django's ``flush`` after each such test TRUNCATEs every table on PostgreSQL
(about 0.1 s for this schema's tables, each one's files replaced), then sends
``post_migrate``, whose receivers look up every content type and permission
again and write them anew under new ids (and the suite's seeded policy with
them: a hundred queries). Here the tables are emptied with ``DELETE``
(milliseconds for the few rows a test leaves), and the rows the migrations
wrote — the seeded policy, the content types and the permissions — are
copied back from tables kept beside them when the test database was created
(``as_migrated__<table>``), ids included: every running process's cached
content type ids stay right, and ``post_migrate`` is not sent
(tests/conftest.py). Nothing but the suite's own setup and teardown uses
these backends: servers and workers the tests start connect with the
project's."""

PREFIX = "as_migrated__"

_kept: dict[str, list[tuple[str, list[str]]]] = {}


def keep_as_migrated(connection) -> None:
    """Copy every table that holds rows right after the migrations (and
    their ``post_migrate``) into ``as_migrated__<table>``."""
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        for table in sorted(connection.introspection.django_table_names(only_existing=True)):
            cursor.execute(f"SELECT 1 FROM {quote(table)} LIMIT 1")
            if cursor.fetchone():
                cursor.execute(f"DROP TABLE IF EXISTS {quote(PREFIX + table)}")
                cursor.execute(f"CREATE TABLE {quote(PREFIX + table)} AS SELECT * FROM {quote(table)}")
    _kept.pop(connection.settings_dict["NAME"], None)


class KeepingAsMigrated:
    """For a backend's ``DatabaseCreation``: the test database, once
    migrated, keeps copies of the rows its migrations wrote."""

    def create_test_db(self, *args, **kwargs):
        name = super().create_test_db(*args, **kwargs)
        keep_as_migrated(self.connection)
        return name


def _kept_tables(connection) -> list[tuple[str, list[str]]]:
    """(table, columns) of each kept copy, read once a process."""
    name = connection.settings_dict["NAME"]
    if name not in _kept:
        with connection.cursor() as cursor:
            copies = sorted(table for table in connection.introspection.table_names(cursor)
                            if table.startswith(PREFIX))
            _kept[name] = [(copy.removeprefix(PREFIX),
                            [column.name for column in connection.introspection.get_table_description(cursor, copy)])
                           for copy in copies]
    return _kept[name]


def restore_as_migrated(connection, tables) -> list[str]:
    """The statements that copy the kept rows of ``tables`` back, to run
    right after those tables are emptied, in the same transaction."""
    quote = connection.ops.quote_name
    flushed = set(tables)
    statements = []
    for table, columns in _kept_tables(connection):
        if table in flushed:
            names = ", ".join(quote(column) for column in columns)
            statements.append(f"INSERT INTO {quote(table)} ({names}) SELECT {names} FROM {quote(PREFIX + table)}")
    return statements
