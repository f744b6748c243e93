"""`yes` for 60 s through the shim with a 1 MiB log cap: prints the log size,
the bytes dropped, and how much the calling (worker) process's RSS grew.

    .venv/bin/python bench/bench_log_flood.py [--seconds 60]
"""

import argparse
import os
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")
# Debug off, as deployed: the settings then want a key and host names.
os.environ.setdefault("DJANGO_SECRET_KEY", "execgo-bench-only-" + "0123456789abcdef" * 3)
os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
os.environ.setdefault("EXECGO_DATA_DIR", tempfile.mkdtemp(prefix="execgo-flood-"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60)
    args = parser.parse_args()
    import django

    django.setup()
    import psutil

    from runtime import executor, forkserver, layout
    from runtime.plan_resolver import resolve_plan

    cap = 1024 * 1024
    handle = f"flood-{uuid.uuid4().hex[:8]}"
    plan = resolve_plan({"profile": "process", "limits": {"log_cap_bytes": cap}})
    worker = psutil.Process()
    before = worker.memory_info().rss
    result = executor.execute(handle, tool="shell", params={"argv": ["yes"]}, timeout_s=args.seconds, attempt=1,
                              plan=plan)
    grown = worker.memory_info().rss - before
    log = layout.task_dir(handle) / "stdout.log"
    details = result["details"]
    print(f"yes for {args.seconds:.0f} s: termination={details['termination']} log={log.stat().st_size} bytes "
          f"(cap {cap}), dropped={details['stdout_truncated_bytes']} bytes, "
          f"worker RSS grew {grown / 1024 / 1024:.1f} MiB")
    forkserver.stop_server(layout.tasks_dir())


if __name__ == "__main__":
    main()
