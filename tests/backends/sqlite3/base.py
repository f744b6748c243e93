"""SQLite, whose flush puts the rows the migrations wrote back (see
tests/backends/__init__.py); it empties the tables as Django does."""

from django.db.backends.sqlite3 import base, creation, operations

from tests.backends import KeepingAsMigrated, restore_as_migrated


class DatabaseOperations(operations.DatabaseOperations):
    def sql_flush(self, style, tables, *, reset_sequences=False, allow_cascade=False):
        emptied = super().sql_flush(style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade)
        return [*emptied, *restore_as_migrated(self.connection, tables)]


class DatabaseCreation(KeepingAsMigrated, creation.DatabaseCreation):
    pass


class DatabaseWrapper(base.DatabaseWrapper):
    ops_class = DatabaseOperations
    creation_class = DatabaseCreation
