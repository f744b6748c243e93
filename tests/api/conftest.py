"""A Daphne server of the whole ASGI application (the waiting consumers
included) against the test database, for tests that talk HTTP to it.

It gets a data directory of its own, and with it a filesystem broker no
worker reads: a run submitted to it stays queued and nothing it names is
ever executed. Outbound HTTP from it or from a client started beside it
goes to a proxy address where nothing listens."""

from pathlib import Path

import pytest
from django.conf import settings

from tests.conftest import _worker_env
from tests.pages.conftest import DaphneServer

NOWHERE_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens on it here


def offline_env() -> dict:
    return {"HTTP_PROXY": NOWHERE_PROXY, "HTTPS_PROXY": NOWHERE_PROXY, "ALL_PROXY": NOWHERE_PROXY,
            "http_proxy": NOWHERE_PROXY, "https_proxy": NOWHERE_PROXY, "all_proxy": NOWHERE_PROXY,
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


class ApiServer(DaphneServer):
    """The web test server, with a data directory and broker of its own."""

    def __init__(self):
        super().__init__(log_name="api-server.log")
        self.data_dir = Path(settings.DATA_DIR) / "api-server"

    def env(self) -> dict:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return {
            **_worker_env(), **offline_env(),
            "EXECGO_DATA_DIR": str(self.data_dir),
            "CELERY_BROKER_URL": "filesystem://",  # under its own data dir: no worker reads it
            "CELERY_TASK_ALWAYS_EAGER": "false",
            "EXECGO_CALLBACK_ALLOWED_HOSTS": "", "EXECGO_APPROVAL_WEBHOOK_URL": "", "EXECGO_LLM_URL": "",
            # Long polls and waits cut short: a fuzzer waits on each one.
            "EXECGO_API_LONG_POLL_MAX_S": "0.1", "EXECGO_API_WAIT_MAX_S": "0.1",
            "EXECGO_API_THROTTLE_RATE": "100000/minute",
        }


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


# The fuzz tests' lines, recorded as their reports' "schemathesis" properties,
# are printed in pytest's terminal summary, so the figures show in every run's
# output (-s or not, and from an xdist worker too).


def pytest_terminal_summary(terminalreporter):
    lines = [value for reports in terminalreporter.stats.values() for report in reports
             if getattr(report, "when", None) == "call"
             for name, value in getattr(report, "user_properties", ()) if name == "schemathesis"]
    if lines:
        terminalreporter.section("schemathesis")
        for line in lines:
            terminalreporter.write_line(line)
