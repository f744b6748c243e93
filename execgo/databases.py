"""The DATABASES setting, from DATABASE_URL.

Kept apart from the settings because the embedded default (SQLite) needs
tuning of its own before several processes can write to it at once, and
because the audit rows need a second connection to the same database.
"""

from pathlib import Path
from typing import Any

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

# Set by the web process (execgo/asgi.py) before the settings load. Django's
# ASGI handler runs each request's code in a thread of its own, and a
# connection belongs to its thread: without a pool every request would open
# (and the database fork a backend for) a connection of its own.
pooled_process = False


def use_a_pool() -> None:
    """This process shares a pool of PostgreSQL connections among its
    threads. Never a process that forks workers (a Celery worker's pool
    processes would inherit the pool's connections)."""
    global pooled_process
    pooled_process = True


def databases(url: str, *, conn_max_age: int, pool_size: int, data_dir: Path) -> dict[str, dict[str, Any]]:
    """``default`` from the URL, and ``audit``, a second connection to it.
    On PostgreSQL, in the web process: a pool of at most ``pool_size``
    connections each (``use_a_pool``; on SQLite a connection a request
    there); elsewhere a connection a thread, kept for ``conn_max_age``
    seconds and checked before it is used again.

    A malformed URL stops the start instead of falling back to SQLite."""
    pooled = pooled_process and pool_size > 0 and url.startswith(("postgres://", "postgresql://"))
    try:
        # The web process never keeps a connection a thread: its threads come and go with the requests.
        default = dj_database_url.parse(url, conn_max_age=0 if pooled_process else conn_max_age,
                                        conn_health_checks=True)
    except ValueError as exc:
        raise ImproperlyConfigured(f"DATABASE_URL is not a database URL: {exc}") from None
    if pooled:
        default.setdefault("OPTIONS", {})["pool"] = {"min_size": 1, "max_size": pool_size, "timeout": 30}

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
