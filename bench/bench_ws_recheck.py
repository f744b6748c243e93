"""What keeping websockets to their sessions costs: one check of every
socket of a web process (runs/sessions.py ``verdicts``), the queries it
makes and its median and p95 time, for a process holding ``--sockets``
sockets of ``--users`` signed-in users. A web process makes this check every
``EXECGO_WS_RECHECK_S`` (1 s), whatever its number of sockets.

    .venv/bin/python bench/bench_ws_recheck.py [--sockets 1000] [--users 200] [--checks 50]

Runs on SQLite in a temporary EXECGO_DATA_DIR unless DATABASE_URL is set
(then on that database: give it one of its own, the bench adds users).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sockets", type=int, default=1000)
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--checks", type=int, default=50)
    args = parser.parse_args()
    os.environ.setdefault("EXECGO_DATA_DIR", tempfile.mkdtemp(prefix="execgo-bench-ws-"))
    os.environ["DJANGO_SETTINGS_MODULE"] = "execgo.settings"
    os.environ.setdefault("DJANGO_DEBUG", "true")  # a bench needs no secret key
    sys.path.insert(0, str(ROOT))
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, check=True)

    import django

    django.setup()
    from django.contrib.auth.hashers import make_password
    from django.contrib.auth.models import Group, User
    from django.contrib.sessions.backends.db import SessionStore
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from runs.models import Membership, Tenant
    from runs.sessions import grant_for, verdicts

    tenant = Tenant.objects.create(name=f"bench-ws-{time.time_ns()}")
    approvers, _ = Group.objects.get_or_create(name="approvers")
    password = make_password("bench-password")
    users = User.objects.bulk_create([User(username=f"{tenant.name}-{n}", password=password)
                                      for n in range(args.users)])
    users = list(User.objects.filter(username__startswith=f"{tenant.name}-"))
    Membership.objects.bulk_create([Membership(user=user, tenant=tenant) for user in users])
    approvers.user_set.add(*users[::2])
    grants = []
    for n in range(args.sockets):
        user = users[n % len(users)]
        session = SessionStore()
        session["_auth_user_id"] = str(user.pk)
        session.create()
        grants.append(grant_for(user, session.session_key, tenant_id=tenant.pk, needs_approver=n % 4 == 0))

    with CaptureQueriesContext(connection) as queries:
        outcome = verdicts(grants)
    assert outcome.count(None) == len(grants), "every grant holds: the figure is of the full check"
    timings = []
    for _ in range(args.checks):
        started = time.perf_counter()
        verdicts(grants)
        timings.append((time.perf_counter() - started) * 1000)
    timings.sort()
    print(f"session check of {args.sockets} sockets ({args.users} users, {connection.vendor}): "
          f"{len(queries.captured_queries)} queries; median {statistics.median(timings):.1f} ms, "
          f"p95 {timings[int(len(timings) * 0.95) - 1]:.1f} ms "
          f"({statistics.median(timings) * 1000 / args.sockets:.1f} us a socket)")


if __name__ == "__main__":
    main()
