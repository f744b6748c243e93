"""Commit → browser latency of the live relay: how long after a state change
is written its event reaches a websocket client, over N state changes
(default 200), on PostgreSQL + Redis with a real Celery worker and a Daphne
web process.

    .venv/bin/python bench/bench_live_latency.py [--transitions 200]

The client subscribes to its tenant's runs (``scope=runs``) and receives
every ``run_state_changed`` event; the latency of one is the time it was
received minus the event's timestamp (taken in the transaction that wrote
it, just before its commit: the figure includes the commit). Runs of one
``true`` step are submitted one after another, 8 state changes each.

Also prints the database reads the web process made per relayed event: the
index and sequential scans of the Event table during the bench (PostgreSQL's
statistics) over the events relayed; only the relay and the one backlog
read of the client read that table here.
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

from benchdb import ensure_database
from benchprocs import start_web, start_worker, stop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/execgo_bench")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/13")
os.environ.setdefault("EXECGO_DATA_DIR", str(ROOT / "var" / "bench-live"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")
# Debug off, as deployed: the settings then want a key and host names.
os.environ.setdefault("DJANGO_SECRET_KEY", "execgo-bench-only-" + "0123456789abcdef" * 3)
os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
os.environ["EXECGO_LOG_LEVEL"] = "WARNING"


def event_table_scans() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")  # a fresh read of the statistics, not this transaction's
        cursor.execute("SELECT coalesce(seq_scan, 0) + coalesce(idx_scan, 0) FROM pg_stat_user_tables "
                       "WHERE relname = 'runs_event'")
        return cursor.fetchone()[0]


async def listen(url: str, cookie: str, wanted: int, received: list, ready: asyncio.Event) -> None:
    from websockets.asyncio.client import connect

    async with connect(url, additional_headers={"Cookie": f"sessionid={cookie}"}, origin="http://127.0.0.1") as ws:
        while len(received) < wanted:
            message = json.loads(await asyncio.wait_for(ws.recv(), 60))
            if message["type"] == "ready":
                ready.set()
            elif message["type"] == "event":
                received.append((time.time(), message["event"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transitions", type=int, default=200)
    args = parser.parse_args()

    ensure_database(os.environ["DATABASE_URL"])
    import django

    django.setup()
    from django.conf import settings
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.test import Client
    from rest_framework.test import APIClient

    from execgo.celery import app
    from runs.models import Event, Membership, Tenant

    call_command("migrate", verbosity=0)
    app.control.purge()
    tenant, _ = Tenant.objects.get_or_create(name="bench-live")
    user, _ = User.objects.get_or_create(username="bench-live-agent")
    Membership.objects.get_or_create(user=user, defaults={"tenant": tenant})
    api = APIClient()
    api.force_authenticate(user)
    browser = Client()
    browser.force_login(user)
    cookie = browser.cookies[settings.SESSION_COOKIE_NAME].value

    data_dir = Path(os.environ["EXECGO_DATA_DIR"])
    worker = start_worker(data_dir)
    web, port = start_web(data_dir)
    try:
        after = Event.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
        url = f"ws://127.0.0.1:{port}/ws/live/?scope=runs&after={after}"
        plan = {"steps": [{"id": "only", "tool": "shell", "params": {"argv": ["true"]}}]}
        received: list = []

        async def run() -> int:
            ready = asyncio.Event()
            listener = asyncio.create_task(listen(url, cookie, args.transitions, received, ready))
            await asyncio.wait_for(ready.wait(), 30)
            scans_before = await asyncio.to_thread(event_table_scans)
            while len(received) < args.transitions and not listener.done():
                response = await asyncio.to_thread(api.post, "/api/v1/runs", {"plan": plan}, format="json")
                assert response.status_code == 201, response.content
                run_id, seen = response.json()["id"], len(received)
                while not listener.done() and not any(
                        event["run_id"] == run_id and event["data"]["to"] == "SUCCEEDED"
                        for _, event in received[seen:]):
                    await asyncio.sleep(0.01)
            await listener
            await asyncio.sleep(1.5)  # statistics are flushed asynchronously
            return await asyncio.to_thread(event_table_scans) - scans_before

        scans = asyncio.run(run())
        latencies = sorted((at - datetime.fromisoformat(event["timestamp"]).timestamp()) * 1000
                           for at, event in received[: args.transitions])
        relayed = Event.objects.filter(pk__gt=after).count()
        p95 = latencies[max(0, round(0.95 * len(latencies)) - 1)]
        print(f"{len(latencies)} state changes, commit -> websocket client: p50 {statistics.median(latencies):.1f} ms, "
              f"p95 {p95:.1f} ms, max {latencies[-1]:.1f} ms "
              f"({os.environ['DATABASE_URL'].split(':')[0]} + {os.environ['CELERY_BROKER_URL'].split(':')[0]})")
        print(f"web process reads of the Event table: {scans} for {relayed} events written "
              f"({scans / max(relayed, 1):.3f} per event)")
    finally:
        stop(web, worker)


if __name__ == "__main__":
    main()
