"""The DATABASES setting, from DATABASE_URL.

Kept apart from the settings because the embedded default (SQLite) needs
tuning of its own before several processes can write to it at once, and
because the audit rows need a second connection to the same database.
"""

from pathlib import Path
from typing import Any

import dj_database_url
from django.core.exceptions import ImproperlyConfigured


def databases(url: str, *, conn_max_age: int, data_dir: Path) -> dict[str, dict[str, Any]]:
    """``default`` from the URL, and ``audit``, a second connection to it.

    A malformed URL stops the start instead of falling back to SQLite."""
    try:
        default = dj_database_url.parse(url, conn_max_age=conn_max_age)
    except ValueError as exc:
        raise ImproperlyConfigured(f"DATABASE_URL is not a database URL: {exc}") from None

    if default["ENGINE"] == "django.db.backends.sqlite3":
        # Web, workers and beat write concurrently: WAL lets readers proceed, the
        # busy timeout queues writers, and IMMEDIATE takes the write lock at BEGIN
        # so no transaction has to upgrade a read lock mid-way ("database is locked").
        default["OPTIONS"] = {
            "timeout": 30,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        }
        default["TEST"] = {"NAME": str(data_dir / "test-execgo.sqlite3")}

    return {
        "default": default,
        # A second connection to the same database, used only for audit rows that
        # must survive the rollback of the caller's transaction (invalid
        # transitions). It mirrors "default" in tests so it sees the test database.
        "audit": {**default, "TEST": {**default.get("TEST", {}), "MIRROR": "default"}},
    }
