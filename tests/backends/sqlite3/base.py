"""SQLite, whose flush keeps the content types and permissions (see
tests/backends/__init__.py); it empties the other tables as Django does."""

from django.db.backends.sqlite3 import base, operations

from tests.backends import emptied


class DatabaseOperations(operations.DatabaseOperations):
    def sql_flush(self, style, tables, *, reset_sequences=False, allow_cascade=False):
        return super().sql_flush(style, emptied(tables), reset_sequences=reset_sequences, allow_cascade=allow_cascade)


class DatabaseWrapper(base.DatabaseWrapper):
    ops_class = DatabaseOperations
