"""The processes a bench starts: a real Celery worker and a Daphne web
process against the bench's database, stopped with their process groups."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(argv, cwd=ROOT, env=os.environ.copy(), stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def start_worker(data_dir: Path, concurrency: int = 2) -> subprocess.Popen:
    return _start([sys.executable, "-m", "celery", "-A", "execgo", "worker", "-P", "prefork", "-c", str(concurrency),
                   "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING"],
                  data_dir / "bench-worker.log")


def start_web(data_dir: Path) -> tuple[subprocess.Popen, int]:
    """Daphne on a free port, once it accepts connections (its log is quiet at WARNING)."""
    port, log = free_port(), data_dir / "bench-daphne.log"
    web = _start([sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "execgo.asgi:application"],
                 log)
    deadline = time.monotonic() + 60
    while not _listening(port):
        if web.poll() is not None or time.monotonic() > deadline:
            stop(web)
            raise SystemExit(f"daphne did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return web, port


def stop(*procs: subprocess.Popen, wait_s: float = 30.0) -> None:
    """SIGTERM to each process group, then wait ``wait_s`` at most for them
    all (a worker finishes the tasks in hand first: after a backlog that
    took more than 30 s once); a group still there then is killed."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            print(f"process {proc.pid} still there {wait_s:.0f} s after SIGTERM: killed", file=sys.stderr)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
