"""Approval click → first step started: the time from an approver's
approve request to the run's first step starting on a worker, on
PostgreSQL + Redis with a real Celery worker process.

    .venv/bin/python bench/bench_approval_latency.py [--repeat 20]

Each sample submits a run a rule of the bench's own rates high (its first
step is `echo pip install …`, harmless), waits for its approval request, then
POSTs /api/v1/approvals/<id>/approve as an approver (what the page's button
does through the same service) and reads the first step's started_at.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from benchdb import ensure_database
from benchprocs import start_worker, stop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/execgo_bench")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/13")
os.environ.setdefault("EXECGO_DATA_DIR", str(ROOT / "var" / "bench-approval"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")
# Debug off, as deployed: the settings then want a key and host names.
os.environ.setdefault("DJANGO_SECRET_KEY", "execgo-bench-only-" + "0123456789abcdef" * 3)
os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
os.environ["EXECGO_LOG_LEVEL"] = "WARNING"


def wait_for(predicate, timeout: float = 60.0, poll: float = 0.005):
    deadline = time.monotonic() + timeout
    while (value := predicate()) is None:
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        time.sleep(poll)
    return value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()

    ensure_database(os.environ["DATABASE_URL"])
    import django

    django.setup()
    import importlib

    from django.apps import apps
    from django.contrib.auth.models import Group, User
    from django.core.management import call_command
    from rest_framework.test import APIClient

    from approvals.models import APPROVERS_GROUP, ApprovalRequest
    from execgo.celery import app
    from runs.models import Membership, Step, Tenant

    call_command("migrate", verbosity=0)
    importlib.import_module("runs.migrations.0003_seed_policy").seed_policy(apps, None)
    # The seeded rules read the parsed command (echo): this one rates the harmless step high, as the tests' does.
    from policy.models import PolicyRule
    from policy.rules import policy_rule_save
    if not PolicyRule.objects.filter(name="bench-echo-pip-install").exists():
        policy_rule_save(PolicyRule(name="bench-echo-pip-install", tool="shell", field="words",
                                    pattern=r"^echo pip install", outcome="high", priority=1,
                                    reason="stands for a package install in the bench"))
    app.control.purge()
    tenant, _ = Tenant.objects.get_or_create(name="bench-approval")
    agent, _ = User.objects.get_or_create(username="bench-approval-agent")
    approver, _ = User.objects.get_or_create(username="bench-approver")
    for user in (agent, approver):
        Membership.objects.get_or_create(user=user, defaults={"tenant": tenant})
    approver.groups.add(Group.objects.get_or_create(name=APPROVERS_GROUP)[0])
    as_agent, as_approver = APIClient(), APIClient()
    as_agent.force_authenticate(agent)
    as_approver.force_authenticate(approver)

    data_dir = Path(os.environ["EXECGO_DATA_DIR"])
    data_dir.mkdir(parents=True, exist_ok=True)
    worker = start_worker(data_dir)
    plan = {"steps": [{"id": "install", "tool": "shell", "params": {"argv": ["echo", "pip", "install", "nothing"]}}]}
    try:
        samples = []
        for index in range(args.repeat + 1):  # the first one warms the worker up and is not counted
            response = as_agent.post("/api/v1/runs", {"plan": plan}, format="json")
            assert response.status_code == 201, response.content
            run_id = response.json()["id"]
            request_id, digest = wait_for(lambda: ApprovalRequest.objects.filter(run_id=run_id, status="pending")
                                          .values_list("pk", "action_digest").first())
            clicked = time.time()
            response = as_approver.post(f"/api/v1/approvals/{request_id}/approve", {"digest": digest}, format="json")
            assert response.status_code == 200, response.content
            started = wait_for(lambda: Step.objects.filter(run_id=run_id).exclude(started_at=None)
                               .values_list("started_at", flat=True).first())
            if index:
                samples.append((started.timestamp() - clicked) * 1000)
                print(f"run {run_id}: approve -> first step started in {samples[-1]:.1f} ms")
        samples.sort()
        p95 = samples[max(0, round(0.95 * len(samples)) - 1)]
        print(f"approval click -> first step started over {len(samples)} runs: p50 {statistics.median(samples):.1f} ms, "
              f"p95 {p95:.1f} ms, max {samples[-1]:.1f} ms "
              f"({os.environ['DATABASE_URL'].split(':')[0]} + {os.environ['CELERY_BROKER_URL'].split(':')[0]})")
    finally:
        stop(worker)


if __name__ == "__main__":
    main()
