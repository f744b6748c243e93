"""Per-step overhead of the shim: launch + wait of `true` vs a bare posix_spawn of `true`.

Run: .venv/bin/python bench/bench_shim.py [iterations] [profile]

The step runs with the plan a step that names no sandbox gets (the
default: contained), or with the named profile (``process``,
``linux_sandbox``).

Prints median and p95 wall time per step for
  - bare:        os.posix_spawn("/bin/true") + waitpid
  - pre-started: runtime.launcher launch + wait in a spare shim that was
                 told the step ahead and set up its sandbox (what a
                 sequential chain's next step gets: the previous step and
                 its recording give the spare that time; here it is
                 given PRESTART_LEAD_S); the linux_sandbox profile only
  - spare:       runtime.launcher launch + wait in a spare shim the fork
                 server forked while the step was prepared
  - forkserver:  runtime.launcher prepare + launch (fork server) + wait
  - spawn:       the same with a fresh `python -I -S shim.py` per step
and the shim overhead (path minus bare). prepare (writing request.json) is
timed separately: it is part of every step but not of the shim. For each
path, the machine's CPU a step cost, all processes and the kernel's threads
together (this process's preparing, launching and waiting included: a
worker's part of a step, less its database work). Uses a
throw-away data directory unless EXECGO_DATA_DIR is set.
"""

import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
SCRATCH = None
if "EXECGO_DATA_DIR" not in os.environ:
    SCRATCH = tempfile.mkdtemp(prefix="execgo-bench-")
    os.environ["EXECGO_DATA_DIR"] = SCRATCH
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")
# Debug off, as deployed: the settings then want a key and host names.
os.environ.setdefault("DJANGO_SECRET_KEY", "execgo-bench-only-" + "0123456789abcdef" * 3)
os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")

import django  # noqa: E402

django.setup()

from benchcpu import CpuSample  # noqa: E402
from django.conf import settings  # noqa: E402

from runtime import attach, forkserver, launcher, layout  # noqa: E402
from runtime.plan_resolver import resolve_plan  # noqa: E402


def summary(samples_ms):
    ordered = sorted(samples_ms)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]


def bench_bare(n):
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        pid = os.posix_spawn("/bin/true", ["/bin/true"], {})
        os.waitpid(pid, 0)
        samples.append((time.perf_counter() - start) * 1000)
    return samples


PRESTART_LEAD_S = 0.02
# The kernel tears a sandbox's namespaces down after it exited, in its own
# threads: the CPU a mode cost is read this long after its last step.
CPU_SETTLE_S = 0.5
PARAMS = {"argv": ["/bin/true"]}


def bench_shim(n, plan, *, use_forkserver, use_spare=False, prestart=False):
    settings.EXECGO_SHIM_FORKSERVER = use_forkserver
    prepare_ms, step_ms, started_by = [], [], set()
    for _ in range(n):
        handle = f"bench-{uuid.uuid4().hex[:12]}"
        spare = None
        if prestart:
            preset = launcher.sandbox_preset(handle, tool="shell", params=PARAMS, plan=plan)
            spare = launcher.warm_shim(plan, preset=preset)
            time.sleep(PRESTART_LEAD_S)
        elif use_spare:
            spare = launcher.warm_shim(plan)
        start = time.perf_counter()
        launcher.prepare(handle, tool="shell", params=PARAMS, timeout_s=30, attempt=1, plan=plan)
        prepared = time.perf_counter()
        launched = launcher.launch(handle, spare=spare)
        result = attach.wait(handle, launched=launched)
        done = time.perf_counter()
        if result["status"] != "success":
            raise SystemExit(f"bench step failed: {result['error']}")
        prepare_ms.append((prepared - start) * 1000)
        step_ms.append((done - prepared) * 1000)
        started_by.add(result["details"]["started_by"])
    if prestart and started_by != {"prestart"}:
        raise SystemExit(f"a pre-started step was started otherwise: {sorted(started_by)}")
    return prepare_ms, step_ms


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    plan = resolve_plan({"profile": sys.argv[2]} if len(sys.argv) > 2 else {})
    print(f"iterations={n} profile={plan['profile']} network={plan.get('network')} uid={plan.get('uid')} "
          f"tree_kill={plan['tree_kill']} python={layout.shim_python()}")
    bench_shim(10, plan, use_forkserver=True)  # warm up: start the fork server, fill caches
    bare_med, bare_p95 = summary(bench_bare(n))
    print(f"{'bare posix_spawn true':<28} median {bare_med:6.2f} ms   p95 {bare_p95:6.2f} ms")
    modes = [("shim in a spare", True, True, False), ("shim via fork server", True, False, False),
             ("shim via python -I -S", False, False, False)]
    if plan["profile"] == "linux_sandbox":
        modes.insert(0, ("shim pre-started in a spare", True, True, True))
    for label, use_forkserver, use_spare, prestart in modes:
        before = CpuSample()
        prepare_ms, step_ms = bench_shim(n, plan, use_forkserver=use_forkserver, use_spare=use_spare,
                                         prestart=prestart)
        time.sleep(CPU_SETTLE_S)
        cpu_ms = (CpuSample().busy_s - before.busy_s) * 1000 / n
        med, p95 = summary(step_ms)
        prep_med, _ = summary(prepare_ms)
        print(
            f"{label:<28} median {med:6.2f} ms   p95 {p95:6.2f} ms   "
            f"overhead median {med - bare_med:6.2f} ms   p95 {p95 - bare_p95:6.2f} ms   "
            f"(prepare median {prep_med:.2f} ms; machine CPU {cpu_ms:.1f} ms a step)"
        )
    forkserver.stop_server(str(settings.EXECGO_TASKS_DIR))
    if SCRATCH:
        shutil.rmtree(SCRATCH, ignore_errors=True)


if __name__ == "__main__":
    main()
