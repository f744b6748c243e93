"""Approvers' e-mail, commit to delivery: the time from the commit of the
transaction that wrote a notification to its message reaching an SMTP
server (aiosmtpd on loopback), through a real worker.

    .venv/bin/python bench/bench_notify.py [--requests 40]

PostgreSQL + Redis (its own database, execgo_bench_notify) unless
DATABASE_URL is set. Each request is a run waiting for approval, made
directly; one request's approvers (two, by e-mail) are told in one
transaction, whose commit time is taken; the SMTP server notes when each
message arrives. Requests are told one at a time, a second apart. Prints
p50/p95/max of commit → delivery.
"""

import argparse
import os
import sys
import time
from email import message_from_bytes
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/execgo_bench_notify")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/12")
os.environ.setdefault("EXECGO_DATA_DIR", str(ROOT / "var" / "bench-notify"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", "execgo-bench-only-" + "0123456789abcdef" * 3)
os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
os.environ["EXECGO_LOG_LEVEL"] = "WARNING"

from benchload import percentiles, prepare, revoke  # noqa: E402
from benchprocs import free_port, start_worker, stop  # noqa: E402


class Inbox:
    def __init__(self):
        self.arrived: dict[str, list[float]] = {}

    async def handle_DATA(self, server, session, envelope):
        message = message_from_bytes(envelope.content)
        self.arrived.setdefault(message["Subject"], []).append(time.time())
        return "250 OK"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args()
    from aiosmtpd.controller import Controller

    inbox, port = Inbox(), free_port()
    smtp = Controller(inbox, hostname="127.0.0.1", port=port)
    smtp.start()
    os.environ.update({"EMAIL_BACKEND": "django.core.mail.backends.smtp.EmailBackend", "EMAIL_HOST": "127.0.0.1",
                       "EMAIL_PORT": str(port)})
    data_dir, tokens = prepare("bench-notify", 1)
    worker = start_worker(data_dir)
    try:
        from datetime import timedelta

        from django.contrib.auth.models import Group, User
        from django.db import transaction
        from django.utils import timezone

        from approvals.models import ApprovalRequest
        from approvals.notify import notify_request
        from runs.models import Job, Membership, Run

        token = tokens[0][0]
        tenant, agent = token.user.membership.tenant, token.user
        approvers = Group.objects.get_or_create(name="approvers")[0]
        for name in ("bench-ann", "bench-ben"):
            user = User.objects.get_or_create(username=name, defaults={"email": f"{name}@example.com"})[0]
            Membership.objects.get_or_create(user=user, defaults={"tenant": tenant})
            user.groups.add(approvers)
        time.sleep(5)  # the worker's start
        committed: dict[str, float] = {}
        for index in range(args.requests):
            job = Job.objects.create(tenant=tenant, created_by=agent)
            run = Run.objects.create(job=job, tenant=tenant, submitted_by=agent, state="AWAITING_HITL",
                                     title=f"bench {index} {time.time():.0f}", plan={"steps": []}, timeout_s=600,
                                     approval_timeout_s=3600, last_state_change_at=timezone.now())
            with transaction.atomic():
                request = ApprovalRequest.objects.create(
                    run=run, tenant=tenant, risk="high", policy_version=1, action_digest="0" * 64,
                    expires_at=timezone.now() + timedelta(hours=1), steps=[])
                notify_request(request, "requested")
            committed[f'[ExecGo] Approval needed: run #{run.pk} "{run.title}" (high)'] = time.time()
            time.sleep(1.0)
        deadline = time.time() + 60
        while sum(len(inbox.arrived.get(subject, [])) for subject in committed) < 2 * len(committed):
            if time.time() > deadline:
                break
            time.sleep(0.2)
        latencies = [(arrived - at) * 1000 for subject, at in committed.items()
                     for arrived in inbox.arrived.get(subject, [])]
        points = percentiles(latencies, (50, 95))
        print(f"approvers' e-mail, commit → SMTP delivery ({os.environ['DATABASE_URL'].split(':')[0]}, worker -c 2): "
              f"{len(latencies)} of {2 * len(committed)} messages; p50 {points[50]:.1f} ms, p95 {points[95]:.1f} ms, "
              f"max {max(latencies, default=float('nan')):.1f} ms")
    finally:
        stop(worker)
        smtp.stop()
        revoke(tokens)


if __name__ == "__main__":
    main()
