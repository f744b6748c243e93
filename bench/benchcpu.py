"""What a load bench's work costs the machine in CPU, by who spends it:
read from /proc before and after (``CpuSample``), so that a figure a
second can be set against what the machine's cores can give.

A process that ends within the span counts in its parent's reaped
children's times (a sandbox's command in bubblewrap's, bubblewrap in its
shim's) only if that parent waits for it. The fork server lets the kernel
reap its shims (it ignores SIGCHLD), so a finished shim's time, and its
sandbox's, is nobody's: it is in "unreaped", the machine's busy time less
every group's (and whatever else ended unwaited for).
"""

import collections
import os
import time

TICK_S = 1 / os.sysconf("SC_CLK_TCK")

# Who, in the order printed: a process's command line (or name) decides.
GROUPS = ("web", "worker", "fork server and sandboxes", "database", "broker", "kernel threads", "bench", "other")


def _group(pid: int, name: str, argv: str) -> str:
    if pid == os.getpid():
        return "bench"
    if not argv:
        return "kernel threads"
    if "daphne" in argv:
        return "web"
    if "celery" in argv:
        return "worker"
    if "forkserver_daemon" in argv or name in ("bwrap", "pasta"):
        return "fork server and sandboxes"
    if name.startswith("postgres") or argv.startswith("postgres"):
        return "database"
    if name.startswith("redis-server"):
        return "broker"
    return "other"


class CpuSample:
    """Every process's CPU time (its own and its reaped children's) and the
    machine's busy time, at one moment."""

    def __init__(self) -> None:
        self.at = time.monotonic()
        self.processes: dict[int, tuple[str, float]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    stat = fh.read()
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    argv = fh.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue  # gone meanwhile
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            # utime, stime, cutime, cstime (proc(5): fields 14 to 17)
            ticks = sum(int(value) for value in fields[11:15])
            self.processes[int(entry)] = (_group(int(entry), name, argv), ticks * TICK_S)
        with open("/proc/stat") as fh:
            times = [int(value) for value in fh.readline().split()[1:]]
        self.busy_s = (sum(times) - times[3] - times[4]) * TICK_S  # all but idle and iowait

    def since(self, earlier: "CpuSample") -> dict[str, float]:
        """CPU seconds each group spent from ``earlier`` to this sample,
        with "unreaped" and "total" (the machine's busy time)."""
        spent: dict[str, float] = collections.Counter()
        for pid, (group, seconds) in self.processes.items():
            before = earlier.processes.get(pid)
            # A pid reused meanwhile (its time went down) counts from zero.
            spent[group] += seconds - before[1] if before and before[1] <= seconds else seconds
        total = self.busy_s - earlier.busy_s
        spent["unreaped"] = max(total - sum(spent.values()), 0.0)
        spent["total"] = total
        return spent


def cpu_line(spent: dict[str, float], per: int, what: str, wall_s: float) -> str:
    """CPU milliseconds per ``what`` by group, and what the machine's cores
    allow at that cost."""
    if per <= 0:
        return f"CPU per {what}: nothing finished"
    cores = os.cpu_count() or 1
    parts = ", ".join(f"{group} {1000 * spent[group] / per:.1f}" for group in (*GROUPS, "unreaped")
                      if spent.get(group))
    per_ms = 1000 * spent["total"] / per
    return (f"CPU per {what} (ms, over {wall_s:.1f} s, the machine {100 * spent['total'] / (wall_s * cores):.0f}% "
            f"busy): {parts}; total {per_ms:.1f}, so at most {1000 * cores / per_ms:.0f} {what}s/s on {cores} "
            "cores")
