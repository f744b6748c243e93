"""A live Daphne server against the test database (websockets included),
Debian's Chromium through Playwright, and signed-in sessions; the users and
the signed-in client of the server-rendered pages' tests (test_pages_*.py)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings
from django.test import Client

from tests.conftest import ROOT, _worker_env, free_port, make_user
from tests.pages.pages_helpers import signed_in

# Playwright's sync API runs an event loop in the test's thread; the ORM
# calls of the tests themselves are still plain synchronous ones.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

CHROMIUM = "/usr/bin/chromium"
PASSWORD = "a-long-enough-password"  # the approver's, typed into the login form
SCREENSHOTS = ROOT / "var" / "screenshots" / ("sqlite" if settings.IS_SQLITE else "postgres")



class DaphneServer:
    """``daphne execgo.asgi:application`` in a process of its own."""

    def __init__(self, *, log_name: str = "daphne.log"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(settings.DATA_DIR) / log_name
        self.proc: subprocess.Popen | None = None

    def env(self) -> dict:
        return _worker_env()

    def start(self) -> "DaphneServer":
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port), "execgo.asgi:application"],
            cwd=ROOT, env=self.env(), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
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


_server: DaphneServer | None = None


@pytest.fixture(scope="session", autouse=True)
def _stop_daphne_at_exit(django_db_setup):
    # Depends on the test database so it is torn down first: the server's
    # connections would keep the database from being dropped.
    yield
    if _server is not None:
        _server.stop()


@pytest.fixture
def live_web(request, transactional_db):
    """The shared Daphne server (started on first use); tests using it need
    ``django_db(transaction=True)`` so the server sees their rows. A test
    that fails shows what the server logged while it ran."""
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = DaphneServer().start()
    request.node.stash[_SERVER_LOG_FROM] = (_server.log_path, _server.log_path.stat().st_size)
    return _server


_SERVER_LOG_FROM = pytest.StashKey[tuple[Path, int]]()
SERVER_LOG_LINES = 80


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    log_from = item.stash.get(_SERVER_LOG_FROM, None)
    if report.failed and report.when == "call" and log_from is not None:
        path, offset = log_from
        with open(path, "rb") as log:
            log.seek(offset)
            lines = log.read().decode(errors="replace").splitlines()[-SERVER_LOG_LINES:]
        report.sections.append((f"the Daphne server's log during the test (its last {SERVER_LOG_LINES} lines)",
                                "\n".join(lines)))
    return report


@pytest.fixture
def approver(tenant):
    """alice, an approver who logs in through the form with PASSWORD."""
    user = make_user("alice", tenant, groups=("approvers",))
    user.set_password(PASSWORD)
    user.save()
    return user


def session_cookie(user) -> str:
    """A signed-in session for ``user``, as the browser's cookie value."""
    client = Client()
    client.force_login(user)
    return client.cookies[settings.SESSION_COOKIE_NAME].value


@pytest.fixture(scope="session")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium (.ci/run does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, live_web):
    context = browser.new_context(viewport={"width": 1280, "height": 900}, base_url=live_web.url)
    page = context.new_page()
    yield page
    context.close()


def screenshot(page, name: str) -> Path:
    """Saved as a test artifact under var/screenshots/<stack>/ (not committed)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def log_in(page, username: str, password: str) -> None:
    page.goto("/accounts/login/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url("**/")


# --- the pages' tests (test_pages_*.py) ----------------------------------------


@pytest.fixture
def user(tenant):
    return make_user("alice", tenant)


@pytest.fixture
def client_for(user):
    return signed_in(user)


@pytest.fixture
def outsider(other_tenant):
    return make_user("outsider", other_tenant)
