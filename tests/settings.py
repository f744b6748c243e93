"""The test suite's settings: the project's own, with DEBUG off as in
production, and a secret key and host list of the suite's own. They go into
the environment, so every process a test starts (a worker, a web server,
``manage.py``) starts on them too.

Under pytest-xdist each worker process (``gw0``, ``gw1``, …) gets what
its tests must not share with another's: a data directory (the SQLite
database, the filesystem broker, task directories, the fork server), Redis
databases of its own, and its own range of sandbox uids (a step's uid
bounds its processes host-wide) and of loopback ports (``EXECGO_TEST_SLOT``,
read by tests/conftest.py). pytest-django gives each its own test
database."""

import os
import re

os.environ.setdefault("DJANGO_SECRET_KEY", "execgo-test-suite-only-" + "0123456789abcdef" * 3)
os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,[::1],testserver")


# The SQLite and the PostgreSQL passes may run side by side (two make
# targets at once): the second's workers take the slots after the first's,
# for uids and ports.
PASS_SLOTS = 8


def _isolate_xdist_worker(worker: str) -> None:
    """Once per xdist worker: the processes it starts inherit the result."""
    index = int(worker.removeprefix("gw"))
    os.environ["EXECGO_TEST_WORKER"] = worker
    on_postgres = os.environ.get("DATABASE_URL", "").startswith("postgres")
    slot = index + (PASS_SLOTS if on_postgres else 0)
    os.environ["EXECGO_TEST_SLOT"] = str(slot)
    data_dir = os.environ.get("EXECGO_DATA_DIR") or os.path.join(os.path.dirname(os.path.dirname(__file__)), "var")
    os.environ["EXECGO_DATA_DIR"] = os.path.join(data_dir, worker)
    for name in ("CELERY_BROKER_URL", "REDIS_URL"):  # redis://host:port/N -> N - 2 × index
        url = os.environ.get(name, "")
        if match := re.fullmatch(r"(redis://.*/)(\d+)", url):
            number = int(match[2]) - 2 * index
            if number < 0:
                raise RuntimeError(f"too many xdist workers for {name}={url}: at most {int(match[2]) // 2 + 1}")
            os.environ[name] = f"{match[1]}{number}"
    base = os.environ.get("EXECGO_SANDBOX_UID", "1000000")
    if base.isdigit():
        count = int(os.environ.get("EXECGO_SANDBOX_UID_COUNT", "1000000"))
        os.environ["EXECGO_SANDBOX_UID"] = str(int(base) + slot * count)


_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _worker and os.environ.get("EXECGO_TEST_WORKER") != _worker:
    _isolate_xdist_worker(_worker)

from execgo.settings import *  # noqa: E402,F403

# The suite's own backends: the project's, emptied more cheaply between
# transactional tests (tests/backends/__init__.py).
for _alias in DATABASES.values():  # noqa: F405
    _alias["ENGINE"] = _alias["ENGINE"].replace("django.db.backends.", "tests.backends.")

# On PostgreSQL the suite's commits do not wait for their WAL to reach the
# disk (``synchronous_commit=off``: about half a millisecond a commit here).
# What a commit makes visible, and when, is the same; only a crash of the
# database server could lose the last ones, and no test crashes it.
for _alias in DATABASES.values():  # noqa: F405
    if _alias["ENGINE"].endswith("postgresql"):
        _alias["OPTIONS"] = {**_alias.get("OPTIONS", {}), "options": "-c synchronous_commit=off"}

# Every process of the suite (the servers and workers it starts too) hashes
# passwords with a fast hasher: users are created in most tests, and one
# PBKDF2 hash costs seconds of CPU on a small machine. PBKDF2, the
# deployment's, still checks a password hashed with it.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher", "django.contrib.auth.hashers.PBKDF2PasswordHasher"]
