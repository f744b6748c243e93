"""PostgreSQL, flushed with ``DELETE`` and put back as migrated (see
tests/backends/__init__.py).

Triggers are skipped for the flush's own transaction
(``session_replication_role = replica``): the audit tables' append-only
triggers, and the foreign keys' checks, since every referencing row goes in
the same transaction. That needs a superuser, as the suite's database user
is; with another user the flush is Django's TRUNCATE."""

from django.db.backends.postgresql import base, creation, operations

from tests.backends import KeepingAsMigrated, restore_as_migrated


class DatabaseOperations(operations.DatabaseOperations):
    def sql_flush(self, style, tables, *, reset_sequences=False, allow_cascade=False):
        if reset_sequences or not self.connection.is_superuser():
            emptied = super().sql_flush(style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade)
        else:
            emptied = ["SET LOCAL session_replication_role = replica",
                       *(f"DELETE FROM {self.quote_name(table)}" for table in sorted(tables))]
        return [*emptied, *restore_as_migrated(self.connection, tables)]


class DatabaseCreation(KeepingAsMigrated, creation.DatabaseCreation):
    def _destroy_test_db(self, test_database_name, verbosity):
        """Dropped ``WITH (FORCE)`` at the end of the session: a connection
        that a thread of this process opened and kept (asgiref's executor
        thread under an in-process websocket or async view test) is ended
        with it, instead of keeping the database from being dropped."""
        self.connection.close_pool()
        with self._nodb_cursor() as cursor:
            cursor.execute(f"DROP DATABASE {self.connection.ops.quote_name(test_database_name)} WITH (FORCE)")


class DatabaseWrapper(base.DatabaseWrapper):
    ops_class = DatabaseOperations
    creation_class = DatabaseCreation
    _superuser: bool | None = None

    def is_superuser(self) -> bool:
        if self._superuser is None:
            with self.cursor() as cursor:
                cursor.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
                row = cursor.fetchone()
            self._superuser = bool(row and row[0])
        return self._superuser
