"""What-if replay time: a new rule replayed over the stored plans of a
tenant's last 500 and 5,000 runs (docs/policy.md#what-if-replay).

    .venv/bin/python bench/bench_replay.py [--samples 3]

PostgreSQL (its own database, execgo_bench_replay) unless DATABASE_URL is
set. The history is made once and kept: 5,000 runs of two shell steps each
(commands cycling through a small corpus: plain, network tools, package
installs, pipelines), written directly as the pipeline would have left them.
Prints the median time of each replay, the steps it rated and the flips.
"""

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/execgo_bench_replay")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/12")
os.environ.setdefault("EXECGO_DATA_DIR", str(ROOT / "var" / "bench-replay"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", "execgo-bench-only-" + "0123456789abcdef" * 3)
os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
os.environ["EXECGO_LOG_LEVEL"] = "WARNING"

from benchload import prepare, revoke  # noqa: E402

HISTORY = 5000
COMMANDS = [["echo", "hello"], ["curl", "-s", "https://example.com"], ["ls", "-la"], ["git", "status"],
            ["pip", "install", "requests"], ["sh", "-c", "curl https://example.com | sh"], ["true"],
            ["python3", "-c", "print(1)"], ["wget", "https://example.org/file"], ["grep", "-r", "TODO", "."]]


def seed(tenant, user) -> int:
    """Make the history up to HISTORY runs; the runs there are."""
    from django.db import transaction
    from django.utils import timezone

    from runs.models import Job, Run, Step
    from runs.step_lifecycle import placing_steps

    have = Run.objects.filter(tenant=tenant).count()
    now = timezone.now()
    for start in range(have, HISTORY, 500):
        with transaction.atomic(), placing_steps():
            count = min(500, HISTORY - start)
            jobs = Job.objects.bulk_create([Job(tenant=tenant, created_by=user) for _ in range(count)])
            plans = [[COMMANDS[(start + i) % len(COMMANDS)], COMMANDS[(start + i + 3) % len(COMMANDS)]]
                     for i in range(count)]
            runs = Run.objects.bulk_create([
                Run(job=job, tenant=tenant, submitted_by=user, state="SUCCEEDED", timeout_s=600,
                    approval_timeout_s=3600, last_state_change_at=now,
                    plan={"steps": [{"id": "a", "tool": "shell", "params": {"argv": plan[0]}},
                                    {"id": "b", "tool": "shell", "params": {"argv": plan[1]}, "depends_on": ["a"]}]})
                for job, plan in zip(jobs, plans)])
            Step.objects.bulk_create([
                Step(run=run, step_id=step_id, position=position, tool="shell", params={"argv": argv}, timeout_s=60,
                     depends_on=["a"] if position else [], status="success", run_status="success")
                for run, plan in zip(runs, plans) for position, (step_id, argv) in enumerate(zip("ab", plan))])
    return Run.objects.filter(tenant=tenant).count()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=3)
    args = parser.parse_args()
    _data_dir, tokens = prepare("bench-replay", 1)
    try:
        from policy.interface import RuleChange, policy_replay
        from policy.models import PolicyRule

        token = tokens[0][0]
        tenant = token.user.membership.tenant
        runs = seed(tenant, token.user)
        rule = PolicyRule(tenant=tenant, name="curl-needs-a-human", tool="shell", field="words",
                          pattern=r"^(curl|wget)\b", outcome="high", reason="fetches from the web", priority=5)
        print(f"what-if replay of a new rule over stored plans ({os.environ['DATABASE_URL'].split(':')[0]}, "
              f"{runs} runs of 2 steps in the tenant's history)")
        for limit in (500, 5000):
            times, report = [], None
            for _ in range(args.samples):
                report = policy_replay(RuleChange(before=None, after=rule), tenant_id=tenant.pk, limit=limit)
                times.append(report.elapsed_ms)
            print(f"  last {limit:>5} runs: median {statistics.median(times):8.1f} ms "
                  f"(min {min(times):.1f}, max {max(times):.1f}); {report.steps} steps rated twice, "
                  f"{len(report.flips)} flips {report.counts()}")
    finally:
        revoke(tokens)


if __name__ == "__main__":
    main()
