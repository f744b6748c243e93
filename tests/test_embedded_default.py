"""The README's `make run` path on the embedded default (SQLite + the
filesystem broker, no services): migrate, bootstrap, start web + worker +
beat from the Procfile, then submit a run with the printed token over real
HTTP and watch it succeed."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from runtime import forkserver

ROOT = Path(__file__).resolve().parent.parent
SERVICE_VARIABLES = ("DATABASE_URL", "CELERY_BROKER_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def request(url: str, token: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if data else "GET", headers={
        "Authorization": f"Token {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture
def embedded_env(tmp_path):
    env = {key: value for key, value in os.environ.items() if key not in SERVICE_VARIABLES}
    return {**env, "EXECGO_DATA_DIR": str(tmp_path / "var"), "PORT": str(free_port()), "PYTHONUNBUFFERED": "1",
            "EXECGO_SWEEP_INTERVAL_S": "2"}


def test_the_embedded_default_runs_a_plan_end_to_end(embedded_env, tmp_path):
    manage = [sys.executable, "manage.py"]
    subprocess.run([*manage, "migrate", "--noinput", "-v0"], cwd=ROOT, env=embedded_env, check=True, timeout=300)
    bootstrap = subprocess.run([*manage, "execgo_bootstrap"], cwd=ROOT, env=embedded_env, check=True,
                               capture_output=True, text=True, timeout=120)
    token = re.search(r"^EXECGO_AGENT_TOKEN=(\w+)$", bootstrap.stdout, re.M).group(1)
    again = subprocess.run([*manage, "execgo_bootstrap"], cwd=ROOT, env=embedded_env, check=True,
                           capture_output=True, text=True, timeout=120)
    assert f"EXECGO_AGENT_TOKEN={token}" in again.stdout  # idempotent

    log = open(tmp_path / "honcho.log", "wb")
    honcho = subprocess.Popen([str(Path(sys.executable).parent / "honcho"), "start"], cwd=ROOT, env=embedded_env,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{embedded_env['PORT']}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{base}/healthz", timeout=2) as response:
                    assert json.loads(response.read()) == {"status": "ok"}
                    break
            except OSError:
                if time.monotonic() > deadline or honcho.poll() is not None:
                    pytest.fail((tmp_path / "honcho.log").read_text()[-3000:])
                time.sleep(0.2)

        run = request(f"{base}/api/v1/runs", token, {"title": "hello", "plan": {"steps": [
            {"id": "greet", "tool": "shell", "params": {"argv": ["echo", "hello"]}},
            {"id": "count", "tool": "shell", "params": {"script": "echo $((40 + 2))"}, "depends_on": ["greet"]},
        ]}})
        deadline = time.monotonic() + 60
        while run["state"] not in {"SUCCEEDED", "CLOSED_FAILED", "CLOSED_REJECTED", "CLOSED_CANCELLED"}:
            if time.monotonic() > deadline:
                pytest.fail(f"run still {run['state']}\n" + (tmp_path / "honcho.log").read_text()[-3000:])
            time.sleep(0.2)
            run = request(f"{base}/api/v1/runs/{run['id']}", token)
        assert run["state"] == "SUCCEEDED"
        assert [step["result"]["output"]["stdout"] for step in run["steps"]] == ["hello\n", "42\n"]
        # Ready once beat has run the sweeper (every 2 s here, see embedded_env).
        deadline = time.monotonic() + 60
        while True:
            try:
                ready = json.loads(urllib.request.urlopen(f"{base}/readyz", timeout=10).read())
                break
            except urllib.error.HTTPError as not_ready:
                if time.monotonic() > deadline:
                    pytest.fail(not_ready.read().decode() + (tmp_path / "honcho.log").read_text()[-3000:])
                time.sleep(0.5)
        assert ready["checks"] == dict.fromkeys(("database", "broker", "channel_layer", "workers", "beat"), "ok")
    finally:
        os.killpg(honcho.pid, signal.SIGTERM)
        try:
            honcho.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(honcho.pid, signal.SIGKILL)
        log.close()
        # The shim fork server outlives its worker by design; this one is done.
        forkserver.stop_server(Path(embedded_env["EXECGO_DATA_DIR"]) / "tasks")
    assert (Path(embedded_env["EXECGO_DATA_DIR"]) / "execgo.sqlite3").exists()
