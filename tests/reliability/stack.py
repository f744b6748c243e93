"""A whole deployment of this test's own, for the tests that break parts of
it: a Redis broker on a free port that keeps nothing (so a restart loses
every queued message), a Daphne web process, beat and a worker, all against
the test database, with the sweeper and the outbox relay ticking every
second and a lost message sent again after 3 s."""

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, WorkerProcess, _worker_env, free_port, make_token, wait_until

FAST = {"EXECGO_SWEEP_INTERVAL_S": "1", "EXECGO_DISPATCH_RELAY_INTERVAL_S": "1",
        **{f"EXECGO_ZOMBIE_{state}_S": "3" for state in ("CREATED", "PREPARING", "PLANNING", "POLICY_CHECK",
                                                          "TRACING", "TRANSIENT", "EXECUTING_IDLE")}}


class Redis:
    """A redis-server of this test's own on a free port, that keeps nothing."""

    def __init__(self, tmp_path: Path):
        self.port, self.dir, self.proc = free_port(), tmp_path, None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.dir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 20
        while subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True,
                             text=True).stdout.strip() != "PONG":
            if time.monotonic() > deadline:
                pytest.fail("redis-server did not start")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Service:
    """A web or beat process of the Procfile against the test database and ``env``."""

    def __init__(self, name: str, argv: list[str], env: dict, tmp_path: Path):
        self.log_path = tmp_path / f"{name}.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env={**_worker_env(), **env}, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


@contextmanager
def running_stack(tmp_path: Path, user, env: dict | None = None):
    """Yield ``(redis, client, (web, beat, worker))``: ``client`` speaks to
    the web process with ``user``'s token. ``env`` is added to ``FAST`` for
    every process."""
    redis = Redis(tmp_path)
    redis.start()
    env = {"CELERY_BROKER_URL": redis.url, **FAST, **(env or {})}
    port = free_port()
    web = Service("web", [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "--access-log",
                          "/dev/null", "execgo.asgi:application"], env, tmp_path)
    beat = Service("beat", [sys.executable, "-m", "celery", "-A", "execgo", "beat", "-l", "INFO",
                            "--schedule", str(tmp_path / "beat-schedule")], env, tmp_path)
    worker = WorkerProcess(hostname="outage", env=env)
    try:
        worker.start()
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30,
                              headers={"Authorization": f"Token {make_token(user)}"})
        wait_until(lambda: _answers(client), timeout=60, what="the web process answering")
        yield redis, client, (web, beat, worker)
        client.close()
    finally:
        worker.stop()
        beat.stop()
        web.stop()
        redis.kill()


def _answers(client: httpx.Client) -> bool:
    try:
        return client.get("/healthz").status_code == 200
    except httpx.TransportError:
        return False
