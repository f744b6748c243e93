"""A Daphne server of the whole ASGI application (the waiting consumers
included) against the test database, for tests that talk HTTP to it.

It gets a data directory of its own, and with it a filesystem broker no
worker reads: a run submitted to it stays queued and nothing it names is
ever executed. Outbound HTTP from it or from a client started beside it
goes to a proxy address where nothing listens."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings

from tests.conftest import ROOT, _worker_env
from tests.web.conftest import free_port

NOWHERE_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens on it here


def offline_env() -> dict:
    return {"HTTP_PROXY": NOWHERE_PROXY, "HTTPS_PROXY": NOWHERE_PROXY, "ALL_PROXY": NOWHERE_PROXY,
            "http_proxy": NOWHERE_PROXY, "https_proxy": NOWHERE_PROXY, "all_proxy": NOWHERE_PROXY,
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


class ApiServer:
    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = Path(settings.DATA_DIR) / "api-server"
        self.log_path = Path(settings.DATA_DIR) / "api-server.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ApiServer":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {
            **_worker_env(), **offline_env(),
            "EXECGO_DATA_DIR": str(self.data_dir),
            "CELERY_BROKER_URL": "filesystem://",  # under its own data dir: no worker reads it
            "CELERY_TASK_ALWAYS_EAGER": "false",
            "EXECGO_CALLBACK_ALLOWED_HOSTS": "", "EXECGO_APPROVAL_WEBHOOK_URL": "", "EXECGO_LLM_URL": "",
            # Long polls and waits cut short: a fuzzer waits on each one.
            "EXECGO_API_LONG_POLL_MAX_S": "0.5", "EXECGO_API_WAIT_MAX_S": "0.5",
            "EXECGO_API_THROTTLE_RATE": "100000/minute",
        }
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port), "execgo.asgi:application"],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while b"Listening on TCP address" not in self.log_path.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daphne did not start:\n{self.log_path.read_text()[-4000:]}")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


_server: ApiServer | None = None


@pytest.fixture(scope="session", autouse=True)
def _stop_api_server_at_exit(django_db_setup):
    yield  # after the tests, before the test database is dropped
    if _server is not None:
        _server.stop()


@pytest.fixture
def api_server(transactional_db):
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = ApiServer().start()
    return _server


# Lines the fuzz test reports; printed in pytest's terminal summary, so the
# figures show in every run's output (-s or not).
FUZZ_SUMMARIES: list[str] = []


def pytest_terminal_summary(terminalreporter):
    if FUZZ_SUMMARIES:
        terminalreporter.section("schemathesis")
        for line in FUZZ_SUMMARIES:
            terminalreporter.write_line(line)
