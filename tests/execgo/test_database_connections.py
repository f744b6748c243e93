"""Database connections are kept, not opened per request or per task
(execgo/databases.py): PostgreSQL forks a backend for each connection, and
opening one a request cost the database more CPU than the queries.

The web process shares a pool among the threads Django's ASGI handler
runs requests in; a worker's processes keep theirs from task to task and
check them first, so a terminated connection costs a task nothing.
"""

import psutil
import pytest
from django.conf import settings
from django.db import connection

from tests.conftest import WorkerProcess, log_tails, make_token, purge_broker, simple_plan, wait_for_run
from tests.pages.conftest import DaphneServer

pytestmark = [
    pytest.mark.skipif(settings.IS_SQLITE, reason="PostgreSQL's connections: SQLite opens a file"),
    pytest.mark.django_db(transaction=True),
]


def database_ports(pid: int) -> set[int]:
    """The local ports of the connections to PostgreSQL that process
    ``pid`` and its children hold open."""
    port = int(connection.settings_dict["PORT"] or 5432)
    processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    found = set()
    for process in processes:
        try:
            found |= {c.laddr.port for c in process.net_connections("tcp") if c.raddr and c.raddr.port == port}
        except psutil.NoSuchProcess:
            pass
    return found


def backends_of(ports: set[int]) -> list[int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pid FROM pg_stat_activity WHERE client_port = ANY(%s)", [list(ports)])
        return [row[0] for row in cursor.fetchall()]


def test_the_web_process_serves_requests_from_a_pool(agent):
    import httpx

    token = make_token(agent)
    server = DaphneServer(log_name="daphne-pool.log").start()
    try:
        seen: set[int] = set()
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Token {token}"}, timeout=30) as client:
            for _ in range(30):
                assert client.get("/api/v1/runs").status_code == 200
                open_now = database_ports(server.proc.pid)
                # Kept between requests: without a pool each request's connection closes with it.
                assert open_now, "no connection kept after a request"
                seen |= open_now
        assert len(seen) <= 8, f"{len(seen)} connections for 30 requests, more than the pool holds"
    finally:
        server.stop()


def test_a_worker_keeps_its_connections_between_tasks_and_replaces_a_terminated_one(agent, tenant):
    from runs.services import run_submit

    def pool_ports() -> set[int]:  # the pool processes', where tasks run
        return set().union(*(database_ports(child.pid) for child in psutil.Process(worker.proc.pid).children()))

    def run_one() -> None:
        run_id = run_submit(tenant=tenant, user=agent, plan=simple_plan(["true"])).run.pk
        assert wait_for_run(run_id).state == "SUCCEEDED", log_tails(worker)

    purge_broker()
    worker = WorkerProcess(hostname="connections").start()
    try:
        run_one()
        first = pool_ports()
        assert first, "the pool processes closed their connections after their tasks"
        for _ in range(6):  # some 20 tasks more
            run_one()
        assert first & pool_ports(), "no connection kept from the first run's tasks to the last's"

        with connection.cursor() as cursor:  # as a database restart or an operator would
            cursor.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid",
                           [backends_of(database_ports(worker.proc.pid))])
        run_one()
    finally:
        worker.stop()
