"""/metrics through prometheus_client: figures read from the database at
scrape time, figures counted in real worker processes, Prometheus's own
checker on the real output, and folding the files of dead processes."""

import os
import select
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from approvals.services import approval_decide
from runs import metrics
from runs import metrics_view as exposition
from runs.metrics import EVENTS_RELAYED
from runs.models import AuditEvent, AuditLog, Event, EventType, Run
from runs.relay import OutboxRelay
from runs.statemachine import RunState
from runtime import ledger
from tests.conftest import ROOT, make_user, open_approval, run_coroutine, wait_for_run

SCRAPER_TOKEN = "scraper-token-of-the-metrics-tests"


@pytest.fixture(autouse=True)
def metrics_token(settings):
    settings.EXECGO_METRICS_TOKEN = SCRAPER_TOKEN


def scrape(client) -> tuple[str, dict]:
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {SCRAPER_TOKEN}")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    text = response.content.decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return text, samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def promtool_check(text: str) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing (Debian's prometheus package; .ci/run installs it)"
    checked = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60)
    assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()


def assert_every_family_documented(text: str) -> None:
    helps = {line.split()[2] for line in text.splitlines() if line.startswith("# HELP ")}
    types = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    names = {family.name for family in text_string_to_metric_families(text)}
    assert names and helps == types
    for family in text_string_to_metric_families(text):
        assert family.documentation, family.name
        assert family.type in {"counter", "gauge", "histogram"}, family.name


def test_state_is_read_from_the_database_at_scrape_time(client, make_run, tenant):
    _, before = scrape(client)
    make_run("SUCCEEDED", closing_cause="succeeded")
    make_run("SUCCEEDED", closing_cause="succeeded")
    make_run("CLOSED_FAILED", closing_cause="run_timeout")
    make_run("EXECUTING")
    open_approval(make_run("AWAITING_HITL", previous_state="POLICY_CHECK"))
    ledger.host_register("metrics-host", task_slots=3)
    assert ledger.reserve("metrics-host", "h-metrics-1", slots=2)
    AuditLog.objects.create(event=AuditEvent.ZOMBIE_DETECTED, caller="zombie sweeper")
    AuditLog.objects.create(event=AuditEvent.INVALID_TRANSITION, caller="test")
    AuditLog.objects.create(event=AuditEvent.INVALID_TRANSITION, caller="test")

    text, samples = scrape(client)
    assert value(samples, "execgo_runs", state="SUCCEEDED") == 2
    assert value(samples, "execgo_runs", state="EXECUTING") == 1
    assert value(samples, "execgo_runs", state="AWAITING_HITL") == 1
    assert ("execgo_runs", (("state", "CLOSED_CANCELLED"),)) in samples  # every state, zero included
    assert value(samples, "execgo_runs_closed_total", closing_cause="succeeded") == 2
    assert value(samples, "execgo_runs_closed_total", closing_cause="run_timeout") == 1
    assert value(samples, "execgo_approvals_pending") == 1
    assert value(samples, "execgo_ledger_capacity", host="metrics-host", resource="task_slots") == 3
    assert value(samples, "execgo_ledger_reserved", host="metrics-host", resource="task_slots") == 2
    assert value(samples, "execgo_zombie_detected_total") == value(before, "execgo_zombie_detected_total") + 1
    assert value(samples, "execgo_invalid_transition_total") == 2
    assert value(samples, "execgo_zombie_recovered_total") == 0
    assert_every_family_documented(text)
    promtool_check(text)


SUCCEEDS = {"steps": [{"id": "one", "tool": "shell", "params": {"argv": ["echo", "one"]}},
                      {"id": "two", "tool": "shell", "params": {"argv": ["true"]}, "depends_on": ["one"]}]}
FAILS = {"steps": [{"id": "bad", "tool": "shell", "params": {"argv": ["sh", "-c", "exit 3"]}}]}


@pytest.mark.django_db(transaction=True)
def test_figures_counted_in_a_real_worker_show_on_the_web(client, api, celery_worker):
    _, before = scrape(client)
    ok = wait_for_run(api.post("/api/v1/runs", {"plan": SUCCEEDS}, format="json").json()["id"])
    bad = wait_for_run(api.post("/api/v1/runs", {"plan": FAILS}, format="json").json()["id"])
    assert (ok.state, bad.state) == ("SUCCEEDED", "CLOSED_FAILED")
    error = bad.steps.get().result["error"]

    text, after = scrape(client)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    # Only a worker moves a run along these edges: this process never ran a step.
    assert delta("execgo_transitions_total", from_state="EXECUTING", to_state="TRACING") == 1
    assert delta("execgo_transitions_total", from_state="EXECUTING", to_state="FAILED") == 1
    assert delta("execgo_transitions_total", from_state="TRACING", to_state="SUCCEEDED") == 1
    assert delta("execgo_transitions_total", from_state="", to_state="CREATED") == 2
    assert delta("execgo_step_duration_seconds_count", tool="shell", status="success") == 2
    assert delta("execgo_step_duration_seconds_count", tool="shell", status="failed") == 1
    assert delta("execgo_step_duration_seconds_bucket", tool="shell", status="success", le="+Inf") == 2
    assert delta("execgo_errors_total", code=error["code"], source=error["source"]) == 1
    assert delta("execgo_runs_closed_total", closing_cause="failed") == 1
    worker_pids = {int(path.stem.rsplit("_", 1)[1]) for path in Path(os.environ["PROMETHEUS_MULTIPROC_DIR"]).glob(
        "counter_*.db") if path.stem.rsplit("_", 1)[1].isdigit()}
    assert worker_pids - {os.getpid()}, "no worker process wrote a metrics file"
    assert_every_family_documented(text)
    promtool_check(text)


def test_a_human_decision_is_timed(client, make_run, tenant, seeded_policy):
    approver = make_user("metrics-approver", tenant, groups=("approvers",))
    run = make_run("AWAITING_HITL", previous_state="POLICY_CHECK")
    request = open_approval(run)
    _, before = scrape(client)
    approval_decide(request=request, digest=request.action_digest, actor=approver, approve=False, comment="not today")
    _, after = scrape(client)
    count = ("execgo_approval_decision_seconds_count", (("outcome", "rejected"),))
    assert after.get(count, 0) - before.get(count, 0) == 1
    assert Run.objects.get(pk=run.pk).state == RunState.CLOSED_REJECTED


@pytest.mark.django_db(transaction=True)
def test_relayed_events_are_counted(client, make_run):
    run = make_run("EXECUTING")
    relay = OutboxRelay()
    events = [Event.objects.create(type=EventType.TASK_PROGRESSED, run=run, timestamp=timezone.now(), message=f"{n}")
              for n in range(3)]
    relay.cursor = events[0].pk - 1  # ids go on after a flushed table: start at the first of these
    own_before = EVENTS_RELAYED._value.get()  # this process's count (others of the host may relay meanwhile)
    _, before = scrape(client)
    run_coroutine(relay._drain)
    assert relay.sent == 3
    _, after = scrape(client)
    assert EVENTS_RELAYED._value.get() - own_before == 3
    assert value(after, "execgo_events_relayed_total") - value(before, "execgo_events_relayed_total") >= 3


COUNT_AND_EXIT = """
from prometheus_client import Counter, Histogram
Counter("folded", "A counter.", ["kind"]).labels("a").inc({n})
Histogram("folded_seconds", "A histogram.").observe(0.2)
"""


def total(directory: Path) -> dict:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples}


def test_files_of_dead_processes_are_folded_and_still_counted(tmp_path):
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for n in (2, 5):  # two processes that counted, then exited
        subprocess.run([sys.executable, "-c", COUNT_AND_EXIT.format(n=n)], env=env, cwd=ROOT, check=True, timeout=60)
    # The live process says when it has counted: its files exist from the
    # metrics' creation on, before it observes anything.
    live = subprocess.Popen([sys.executable, "-c", COUNT_AND_EXIT.format(n=1) + "print('counted', flush=True)\n"
                             "import time; time.sleep(60)"], env=env, cwd=ROOT, stdout=subprocess.PIPE)
    try:
        live_files = {f"counter_{live.pid}.db", f"histogram_{live.pid}.db"}
        assert select.select([live.stdout], [], [], 30)[0], "the live process did not count"
        assert live.stdout.readline() == b"counted\n"
        assert live_files <= {p.name for p in tmp_path.iterdir()}
        before = total(tmp_path)
        assert before[("folded_total", (("kind", "a"),))] == 8
        assert exposition.fold_dead_processes(tmp_path) == 4
        assert {p.name for p in tmp_path.iterdir()} == live_files | {"counter_archive.db", "histogram_archive.db"}
        assert total(tmp_path) == before
        assert exposition.fold_dead_processes(tmp_path) == 0  # the live process's files stay its own
    finally:
        live.kill()
        live.wait()
        live.stdout.close()
    assert exposition.fold_dead_processes(tmp_path) == 2
    assert total(tmp_path) == before


def test_label_values_from_a_result_come_from_a_closed_set(db, client, django_capture_on_commit_callbacks):
    forged = {"status": "failed\nevil", "duration_ms": 12, "error": {"code": 'x"} 1\nexecgo_runs{state="SUCCEEDED',
                                                                "source": "shim\n# TYPE evil counter"}}
    _, before = scrape(client)
    with django_capture_on_commit_callbacks(execute=True):
        metrics.count_step_end("shell", forged)
    text, after = scrape(client)
    assert value(after, "execgo_errors_total", code="unknown", source="unknown") == (
        value(before, "execgo_errors_total", code="unknown", source="unknown") + 1)
    assert value(after, "execgo_step_duration_seconds_count", tool="shell", status="unknown") == (
        value(before, "execgo_step_duration_seconds_count", tool="shell", status="unknown") + 1)
    assert "evil" not in text and 'x\\"}' not in text
    promtool_check(text)
