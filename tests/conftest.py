"""Shared fixtures: tenants and users, an API client with a real token, a
factory for runs in any state, and a real Celery worker process."""

import asyncio
import importlib
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from django.conf import settings
from django.contrib.auth.models import Group, User
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.db import connection
from django.test import TransactionTestCase
from django.utils import timezone
from rest_framework.test import APIClient

from runs.models import Job, Membership, Run, Tenant
from runs.statemachine import FINAL, NON_FINAL, RunState
from runs.step_lifecycle import placing_steps

ROOT = Path(__file__).resolve().parent.parent

postgres_only = pytest.mark.skipif(settings.IS_SQLITE, reason="needs PostgreSQL (SQLite serialises writers)")


@pytest.fixture(autouse=True)
def no_dns(monkeypatch):
    """Names resolve from /etc/hosts only (``localhost``): a real DNS query
    would leave the machine. Tests that need a name give their own resolver."""
    from runtime import egress

    def hosts_only(host, port):
        if host.lower() in ("localhost", "ip6-localhost"):
            return ["127.0.0.1"]
        raise OSError(f"no DNS in tests: {host}")

    monkeypatch.setattr(egress, "resolve_name", hosts_only)


@pytest.fixture(autouse=True)
def steps_placed_directly(request):
    """The suite's factories put steps in any state directly
    (``runs.step_lifecycle.placing_steps``); the tests of that guard itself
    (marked ``step_guard``) see the application's rule."""
    if request.node.get_closest_marker("step_guard"):
        yield
        return
    with placing_steps():
        yield


def _seed_policy(apps) -> None:
    """The default policy as the migrations write it, with their own
    functions (a no-op when it is there)."""
    importlib.import_module("runs.migrations.0003_seed_policy").seed_policy(apps, None)
    importlib.import_module("runs.migrations.0011_policy_argv_rules").seed_word_rules(apps, None)


def _flush_as_migrated(self) -> None:
    """After a transactional test: the tables emptied and the rows the
    migrations wrote put back by the suite's backends (tests/backends),
    without Django's ``post_migrate``, whose receivers would only look up
    every content type and permission again (about 40 ms a test)."""
    for db_name in self._databases_names(include_mirrors=False):
        call_command("flush", verbosity=0, interactive=False, database=db_name, reset_sequences=False,
                     allow_cascade=self.available_apps is not None, inhibit_post_migrate=True)
    ContentType.objects.clear_cache()  # a test may have made or renamed some


TransactionTestCase._fixture_teardown = _flush_as_migrated


@pytest.fixture
def seeded_policy(db):
    """The default policy as the migrations write it (a test that changed
    it in its own transaction may ask for it again)."""
    from django.apps import apps

    _seed_policy(apps)


@pytest.fixture
def echo_pip_install_is_high(db):
    """A harmless command the policy rates high: the approval tests submit
    ``echo pip install …``, which must wait for a human yet do nothing when
    run (the parsed command is ``echo``, which the seeded rules rate low)."""
    from policy.models import PolicyRule
    from policy.rules import policy_rule_save

    policy_rule_save(PolicyRule(name="test-echo-pip-install", tool="shell", field="words", pattern=r"^echo pip install",
                                outcome="high", reason="stands for a package install in tests", priority=1))


@pytest.fixture
def tenant(db):
    return Tenant.objects.create(name="acme")


@pytest.fixture
def other_tenant(db):
    return Tenant.objects.create(name="globex")


def make_user(username: str, tenant: Tenant, *, groups: tuple[str, ...] = ()) -> User:
    user = User.objects.create_user(username=username, password="pw-" + username)
    Membership.objects.create(user=user, tenant=tenant)
    for name in groups:
        user.groups.add(Group.objects.get_or_create(name=name)[0])
    return user


def make_person(username: str, tenant: Tenant, *groups: str) -> User:
    """``make_user`` with an e-mail address, ``<username>@example.com`` (the notifications' tests)."""
    user = make_user(username, tenant, groups=groups)
    user.email = f"{username}@example.com"
    user.save(update_fields=["email"])
    return user


@pytest.fixture
def agent(tenant):
    return make_user("agent", tenant, groups=("agents",))


def make_token(user: User, *, name: str = "test", expires_at=None) -> str:
    """A new API token for ``user``; its key (the one time it is known)."""
    from runs.tokens import token_create

    return token_create(user=user, name=name, expires_at=expires_at, caller="test")[1]


def token_client(user: User) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {make_token(user)}")
    return client


@pytest.fixture
def api(agent):
    return token_client(agent)


@pytest.fixture
def make_run(tenant, agent):
    """Test factory: a run placed directly in ``state`` (tests only; the
    application writes states through the transition service)."""

    def factory(state: str = "CREATED", *, previous_state: str = "", closing_cause: str = "", **fields) -> Run:
        job = Job.objects.create(tenant=tenant, created_by=agent)
        now = timezone.now()
        run = Run.objects.create(
            job=job, tenant=tenant, submitted_by=agent, state=state, previous_state=previous_state,
            closing_cause=closing_cause, plan={"steps": [{"id": "a", "tool": "shell", "params": {"argv": ["true"]}}]},
            timeout_s=fields.pop("timeout_s", 600), approval_timeout_s=fields.pop("approval_timeout_s", 3600),
            last_state_change_at=fields.pop("last_state_change_at", now),
            executing_started_at=fields.pop("executing_started_at", now if state == "EXECUTING" else None),
            **fields,
        )
        Job.objects.filter(pk=job.pk).update(latest_run=run)
        return run

    return factory


def simple_plan(*argvs: list[str]) -> dict:
    steps, previous = [], None
    for index, argv in enumerate(argvs):
        step = {"id": f"s{index}", "tool": "shell", "params": {"argv": argv}}
        if previous:
            step["depends_on"] = [previous]
        steps.append(step)
        previous = step["id"]
    return {"steps": steps}


def wait_for_run(run_id: int, *, states=FINAL, timeout: float = 60.0) -> Run:
    """Poll until the run reaches one of ``states``; fail the test otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        run = Run.objects.get(pk=run_id)
        if run.state in states:
            return run
        if time.monotonic() > deadline:
            logs = "".join(f"\n--- {log.name} ---\n{log.read_text(errors='replace')[-3000:]}"
                           for log in Path(settings.DATA_DIR).glob("worker-*.log"))
            pytest.fail(f"run {run_id} still {run.state} after {timeout}s{logs}")
        time.sleep(0.05)


def run_coroutine(coroutine_function, *args, timeout: float = 120.0):
    """Run ``coroutine_function(*args)`` to its end on an event loop of its
    own, in a thread of its own. Not in the test's thread: a process that
    has run a browser test keeps Playwright's loop running there (its sync
    API), where ``asyncio.run`` and ``async_to_sync`` refuse to start."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine_function(*args)).result(timeout=timeout)


def wait_until(predicate, *, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached after {timeout}s")
        time.sleep(0.05)


# Each test process picks the loopback ports of the servers it starts from a
# range of its own (its slot, tests/settings.py: 20000, 20500, …, below the
# kernel's ephemeral range from 32768 for all 16 slots), so two of them never
# choose the same free port between checking it and binding it.
PORT_RANGE = 500
_port_base = 20000 + PORT_RANGE * int(os.environ.get("EXECGO_TEST_SLOT", "0"))
_port_cursor = 0


def free_port() -> int:
    """A loopback port nothing is bound to now, from this process's range."""
    global _port_cursor
    for _ in range(PORT_RANGE):
        port = _port_base + _port_cursor % PORT_RANGE
        _port_cursor += 1
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use, or its last connection still in TIME_WAIT
            return port
    raise RuntimeError(f"no free port in {_port_base}-{_port_base + PORT_RANGE - 1}")


def _worker_env() -> dict:
    db = connection.settings_dict
    if settings.IS_SQLITE:
        database_url = f"sqlite:///{db['NAME']}"
    else:
        database_url = f"postgres://{db['USER'] or ''}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
    return {**os.environ, "DATABASE_URL": database_url, "EXECGO_DATA_DIR": str(settings.DATA_DIR),
            "CELERY_TASK_ALWAYS_EAGER": "false", "PYTHONUNBUFFERED": "1",
            # A worker's start runs Django's system checks only to log what they find (a third of its
            # start's CPU); the suite's workers start dozens of times, and the checks have tests of their own.
            "CELERY_SKIP_CHECKS": "1"}


class WorkerProcess:
    """A real ``celery worker`` process against the test database."""

    def __init__(self, *, hostname: str = "w1", concurrency: int = 2, queues: str = "celery",
                 env: dict | None = None):
        self.hostname = hostname
        self.concurrency = concurrency
        self.queues = queues
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(settings.DATA_DIR) / f"worker-{hostname}.log"

    def start(self) -> "WorkerProcess":
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "execgo", "worker", "-P", "prefork",
             "-c", str(self.concurrency), "-n", f"{self.hostname}@%h", "-Q", self.queues,
             "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO"],
            cwd=ROOT, env={**_worker_env(), **self.env}, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while b"ready." not in self.log_path.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start:\n{self.log_path.read_text()[-4000:]}")
            time.sleep(0.1)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Signal the main process only: it shuts its pool down itself (a
        signal to the whole group also hits the pool processes, and the main
        process then waits for them until the SIGKILL)."""
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def stop_workers(*workers: WorkerProcess) -> None:
    """Stop (SIGTERM, warm shutdown) every started worker, all at once."""
    started = [worker for worker in workers if worker.proc is not None]
    with ThreadPoolExecutor(max_workers=len(started) or 1) as pool:
        list(pool.map(lambda worker: worker.stop(), started))


def log_tails(*workers: WorkerProcess, size: int = 4000) -> str:
    return "".join(f"\n--- {worker.log_path.name} ---\n{worker.log_path.read_text(errors='replace')[-size:]}"
                   for worker in workers if worker.log_path.exists())


def purge_broker() -> None:
    from execgo.celery import app

    app.control.purge()


class SharedWorker:
    """The default worker, started when a test asks for it and stopped
    before a test that must not share the broker with it: one that drives
    runs in-process, or starts workers of its own. (Pausing it is not
    enough: Redis hands a message to a stopped process's pending BRPOP.)"""

    def __init__(self):
        self.worker: WorkerProcess | None = None

    def running(self) -> WorkerProcess:
        if self.worker is None:
            purge_broker()
            self.worker = WorkerProcess().start()
        return self.worker

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None


_shared_worker = SharedWorker()


@pytest.fixture(scope="session", autouse=True)
def _fresh_redis_databases():
    """The suite's Redis databases start empty. A message that a worker
    killed by an earlier run of the suite held unacknowledged comes back
    once its visibility timeout passes, hours later, naming a run or a step
    of whatever database is under test then."""
    import redis

    for url in {settings.CELERY_BROKER_URL, settings.REDIS_URL}:
        if url.startswith("redis://"):
            with redis.Redis.from_url(url) as client:
                client.flushdb()


@pytest.fixture(scope="session", autouse=True)
def _stop_shared_worker_at_exit(django_db_setup):
    # Depends on the test database so it is stopped first: its connections
    # would keep the database from being dropped.
    yield
    _shared_worker.stop()
    stop_fork_servers_under(Path(settings.DATA_DIR))


def stop_fork_servers_under(root: Path) -> None:
    """Stop every shim fork server of a tasks directory under ``root``. A
    worker that stops takes its own with it, but not one killed by a test;
    a fork server left behind would wait out its idle timeout (minutes)
    after the suite has ended."""
    from runtime.forkserver import stop_server
    from runtime.forkserver_daemon import SOCKET_NAME

    for socket_path in root.rglob(SOCKET_NAME):
        stop_server(str(socket_path.parent))


@pytest.fixture
def celery_worker(transactional_db):
    """A real worker process against the test database (shared by
    consecutive tests); tests using it need ``django_db(transaction=True)``
    so the worker sees their rows. Tasks published meanwhile by tests
    without a worker are purged first.

    A test must not end with a run still going: the worker outlives the
    test, and its next writes would meet the flush that empties the tables
    after it (on PostgreSQL the two can deadlock). Its runs get a few
    seconds to stop moving; one that has not fails the test, named."""
    purge_broker()
    yield _shared_worker.running()
    fail_on_runs_in_flight()


# A run in one of these states is the worker's to move on; one waiting for a
# person (or final) is not.
IN_FLIGHT = NON_FINAL - {RunState.AWAITING_HITL}


def fail_on_runs_in_flight(*, grace_s: float = 15.0) -> None:
    deadline = time.monotonic() + grace_s
    while going := list(Run.objects.filter(state__in=IN_FLIGHT).values_list("pk", "state")):
        if time.monotonic() > deadline:
            pytest.fail(f"the test ended with runs in flight (run, state): {going}; wait for them "
                        "(wait_for_run) or cancel them before it ends")
        time.sleep(0.1)


@pytest.fixture(autouse=True)
def _no_shared_worker_unless_asked(request):
    if "celery_worker" not in request.fixturenames:
        _shared_worker.stop()


def open_approval(run: Run, *, approvals_required: int = 1, expires_in_s: float | None = None):
    """Test factory: the pending approval request of a run placed in
    AWAITING_HITL by ``make_run`` (the pipeline opens one on its way there)."""
    from approvals.interface import open_request
    from policy.interface import current_policy_version
    from policy.models import PolicyRule

    rule, _ = PolicyRule.objects.get_or_create(
        name=f"test-quorum-{approvals_required}",
        defaults={"tool": "*", "field": "command", "pattern": "(?!)", "outcome": "high", "reason": "test",
                  "enabled": False, "approvals_required": approvals_required})
    decision = {"risk": "high", "policy_version": current_policy_version(), "steps": [],
                "matched_rules": [{"id": rule.pk, "outcome": "high"}]}
    if expires_in_s is not None:
        Run.objects.filter(pk=run.pk).update(approval_timeout_s=max(int(expires_in_s), 1))
        run.refresh_from_db()
    return open_request(run, decision, now=timezone.now())


# Tests that take tens of seconds on their own, longest first. Under
# pytest-xdist each is a work unit of its own and they are handed out before
# the rest, so that none of them is left to end a pass alone on one process
# while the others have finished (LongTestsFirst). A prefix names every test
# it starts, parametrized ones included.
LONG_TESTS = (
    "tests/api/test_schemathesis.py::test_schemathesis_finds_nothing[agent-run]",
    "tests/runs/test_pool_child_kill.py::test_ten_pool_process_kills_mid_step_on_a_two_slot_worker",
    "tests/api/test_schemathesis.py::test_schemathesis_finds_nothing[",
    "tests/execgo/test_broker_outage.py::test_a_broker_killed_and_restarted_empty_loses_no_run",
    "tests/runs/test_state_machine_properties.py::test_random_operations_keep_every_invariant[",
    "tests/runs/test_worker_recovery.py::test_kill_9_of_the_worker_loses_no_step_and_leaves_none_running",
    "tests/runs/test_two_hosts.py::",
    "tests/reliability/test_faults.py::",
    "tests/reliability/test_broken_fencing.py::",
    "tests/approvals/test_reminders_timing.py::",
    "tests/runs/test_memory.py::test_hundred_successes_write_hundred_memories_and_failures_none",
    "tests/runs/test_cancel_race.py::test_cancel_racing_the_natural_end_never_answers_202_for_a_run_that_ended",
    "tests/runs/test_race_cancel_timeout.py::test_cancel_and_timeout_race_has_exactly_one_winner",
    "tests/approvals/test_decisions.py::test_an_approve_racing_a_reject_has_exactly_one_winner",
    "tests/runs/test_audit_tamper.py::test_the_export_verifies_offline_and_a_tampered_line_does_not",
    "tests/test_make_run.py::",
    "tests/runs/test_routing.py::test_strict_sandbox_steps_run_only_on_the_host_that_has_bubblewrap",
    "tests/approvals/test_interfaces_isolation.py::test_another_tenants_ids_and_missing_ids_are_uniform_404s",
    "tests/runs/test_race_cancel_timeout.py::test_cancel_request_racing_an_approval_is_never_dropped",
    "tests/pages/test_login_lockout.py::test_a_spray_from_many_addresses_slows_the_username_down_but_never_locks_it",
)


def _long_rank(nodeid: str) -> int:
    """The position of the first entry of LONG_TESTS naming the test, or
    len(LONG_TESTS) for the others."""
    return next((rank for rank, prefix in enumerate(LONG_TESTS) if nodeid.startswith(prefix)), len(LONG_TESTS))


def _is_long(nodeid: str) -> bool:
    return _long_rank(nodeid) < len(LONG_TESTS)


def pytest_xdist_make_scheduler(config, log):
    """``-n N`` (pytest-xdist's ``load`` mode) hands the tests out by
    modules, each module's tests on one process in a row (they share its
    module-scoped servers and the shared worker), and the long tests one by
    one, first (the collection order, below). xdist's own ``load`` mode sends
    large batches of consecutive tests, and a batch holding several long
    ones kept one process busy minutes after the others had run out of work."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LongTestsFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return nodeid if _is_long(nodeid) else nodeid.split("::", 1)[0]

        def _assign_work_unit(self, node) -> None:
            """The next unit in order, but a process already holding a long
            test that has not ended gets the next short unit instead (xdist
            keeps more than one test queued on each process)."""
            holds_long = any(_is_long(scope) and False in tests.values()
                             for scope, tests in self.assigned_work.get(node, {}).items())
            if holds_long:
                short = next((scope for scope in self.workqueue if not _is_long(scope)), None)
                if short is not None:
                    self.workqueue.move_to_end(short, last=False)
            super()._assign_work_unit(node)

    config.option.loadscopereorder = False  # the collection's order, long tests first
    return LongTestsFirst(config, log)


def pytest_collection_modifyitems(config, items):
    """The long tests first, longest first, the others in their order.

    Tests that use no database (nor a server or worker, which need one:
    their fixtures ask for it), and tests marked ``stack_free``, run once, on
    the SQLite pass: the shim, the sandbox, the limits, the parser, the
    embedded broker and the import contracts do not change with the database,
    and running them twice would only cost CI time."""
    items.sort(key=lambda item: _long_rank(item.nodeid))
    if settings.IS_SQLITE:
        return
    once = pytest.mark.skip(reason="no database involved: run on the SQLite pass")
    for item in items:
        uses_db = item.get_closest_marker("django_db") or {"db", "transactional_db"} & set(item.fixturenames)
        if item.get_closest_marker("stack_free") or not uses_db:
            item.add_marker(once)
