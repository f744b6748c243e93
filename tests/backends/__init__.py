"""The suite's database backends: the project's own (PostgreSQL, SQLite)
with a cheaper way of emptying the tables after a transactional test.

Django's ``flush`` after each such test TRUNCATEs every table on PostgreSQL
(about 0.1 s for this schema's 38 tables, each one's files replaced) and
empties the content types and permissions, which ``post_migrate`` then
writes again under new ids. Here the tables are emptied with ``DELETE``
(milliseconds for the few rows a test leaves) and the content types and
permissions stay, with the ids every running process has cached. Nothing
but the suite's own teardown uses these backends: servers and workers the
tests start connect with the project's."""

KEPT = frozenset({"django_content_type", "auth_permission"})


def emptied(tables) -> list[str]:
    """The tables a flush empties, in a stable order."""
    return sorted(table for table in tables if table not in KEPT)
