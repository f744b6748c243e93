"""The run page and its log tail, through Django's test client: the plan's
DAG and the steps, the timeline by stage and the audit rows, the live
fragment, an unknown run, hostile titles and step ids escaped; a step's
output from an offset, X-Step-Running, and an unknown step's log."""

import re
import shutil
import uuid

import pytest
from django.utils import timezone

from runs.models import AuditLog, Trace, TraceKind
from tests.pages.pages_helpers import add_step, html_of, tags

pytestmark = pytest.mark.django_db

HOSTILE = "<script>alert(1)</script>"
ESCAPED_HOSTILE = "&lt;script&gt;alert(1)&lt;/script&gt;"


# --- the run page ---------------------------------------------------------------


def test_the_run_page_shows_the_plan_dag_and_the_steps(client_for, make_run):
    run = make_run("EXECUTING", title="three steps")
    add_step(run, "fetch", 0, status="success")
    add_step(run, "build", 1, "fetch", status="running")
    add_step(run, "ship", 2, "fetch", "build")
    response = client_for.get(f"/runs/{run.pk}/")
    assert response.status_code == 200
    html = html_of(response)
    svg = re.search(r'<svg xmlns="http://www.w3.org/2000/svg" class="dag".*?</svg>', html, re.S).group(0)
    nodes = [g for g in tags(svg, "g") if "dag-node" in g.get("class", "").split()]
    assert [node["data-step"] for node in nodes] == ["fetch", "build", "ship"]
    assert [node["class"] for node in nodes] == ["dag-node step-success", "dag-node step-running",
                                                 "dag-node step-pending"]
    assert len([p for p in tags(svg, "path") if p.get("class") == "dag-edge"]) == 3
    steps = [a for a in tags(html, "article") if "step" in a.get("class", "").split()]
    assert [(a["data-step"], a["data-status"]) for a in steps] == [("fetch", "success"), ("build", "running"),
                                                                     ("ship", "pending")]
    assert "after fetch, build" in html
    assert 'id="cancel-run"' in html


def test_a_run_without_steps_says_so(client_for, make_run):
    run = make_run("CREATED")
    html = html_of(client_for.get(f"/runs/{run.pk}/"))
    assert "No steps yet (the plan is made in PLANNING)." in html
    assert 'class="dag"' not in html


def test_the_run_page_shows_the_timeline_by_stage_and_the_audit_rows(client_for, tenant, agent, make_run):
    run = make_run("CLOSED_FAILED", closing_cause="failed")
    other = make_run("SUCCEEDED")
    for from_state, to_state in [("", "CREATED"), ("CREATED", "PREPARING"), ("PREPARING", "PLANNING"),
                                 ("PLANNING", "FAILED"), ("FAILED", "TRACING"), ("TRACING", "CLOSED_FAILED")]:
        Trace.objects.create(run=run, kind=TraceKind.TRANSITION, from_state=from_state, to_state=to_state,
                             data={"caller": "test-caller"})
    Trace.objects.create(run=other, kind=TraceKind.TRANSITION, from_state="TRACING", to_state="SUCCEEDED")
    AuditLog.objects.create(run=run, tenant=tenant, event="run_created", actor=agent, caller="api",
                            to_state="CREATED")
    AuditLog.objects.create(run=run, tenant=tenant, event="run_failed", caller="tracer", from_state="TRACING",
                            to_state="CLOSED_FAILED")
    AuditLog.objects.create(run=other, tenant=tenant, event="run_succeeded", caller="tracer")
    html = html_of(client_for.get(f"/runs/{run.pk}/"))

    stages = re.findall(r'<div class="stage"><h3>([^<]+)</h3>\s*<ol class="timeline">(.*?)</ol></div>', html, re.S)
    assert [(name, item.count("<li>")) for name, item in stages] == [
        ("1 · Main path", 3), ("3 · Branch (transient)", 1), ("2 · TRACING", 1), ("4 · Closed", 1)]
    assert 'data-state="CLOSED_FAILED">CLOSED_FAILED</span> <span class="muted">by test-caller' in stages[3][1]

    audit = re.search(r'<h2 id="audit-title">Audit</h2>.*?<tbody>(.*?)</tbody>', html, re.S).group(1)
    rows = re.findall(r"<tr><td>[^<]*</td><td>([^<]*)</td><td>([^<]*)</td><td class=\"optional\">([^<]*)</td></tr>",
                      audit)
    assert rows == [("run_created", "agent", "— → CREATED"), ("run_failed", "tracer", "TRACING → CLOSED_FAILED")]


def test_the_live_fragment_is_only_the_live_partial(client_for, make_run):
    run = make_run("EXECUTING", title="live one")
    add_step(run, "a", 0)
    response = client_for.get(f"/runs/{run.pk}/?fragment=live")
    assert response.status_code == 200
    html = html_of(response).strip()
    assert html.startswith('<div id="run-live" data-state="EXECUTING"')
    assert html.endswith("</div>")
    assert "<main" not in html and "<head>" not in html and 'id="output-title"' not in html
    assert "live one" in html and 'class="dag-node' in html
    full = html_of(client_for.get(f"/runs/{run.pk}/"))
    assert 'id="run-live"' in full and 'id="output-title"' in full


def test_an_unknown_run_is_404(client_for):
    assert client_for.get("/runs/999999/").status_code == 404
    assert client_for.get("/runs/999999/?fragment=live").status_code == 404


def test_hostile_titles_and_step_ids_are_escaped(client_for, make_run):
    run = make_run("AWAITING_HITL", title=HOSTILE)
    add_step(run, HOSTILE, 0)
    add_step(run, "after", 1, HOSTILE)
    failed = make_run("CLOSED_FAILED", closing_cause="failed", title=HOSTILE, finished_at=timezone.now())
    for url in [f"/runs/{run.pk}/", f"/runs/{run.pk}/?fragment=live", "/runs/", f"/runs/{run.pk}/row/",
                f"/runs/{failed.pk}/row/", "/"]:
        response = client_for.get(url)
        assert response.status_code == 200, url
        html = html_of(response)
        assert "<script>alert" not in html, url
        assert ESCAPED_HOSTILE in html, url


# --- the log tail ---------------------------------------------------------------


@pytest.fixture
def log_dir(settings):
    """A fresh task directory under EXECGO_TASKS_DIR, removed afterwards."""
    handle_id = f"h-test-{uuid.uuid4().hex[:12]}"
    path = settings.EXECGO_TASKS_DIR / handle_id
    path.mkdir(parents=True)
    yield handle_id, path
    shutil.rmtree(path, ignore_errors=True)


def test_the_log_endpoint_returns_a_steps_output_from_an_offset(client_for, make_run, log_dir):
    handle_id, path = log_dir
    data = b"line one\nline two \xe2\x9c\x93\n"
    (path / "stdout.log").write_bytes(data)
    (path / "stderr.log").write_bytes(b"oops\n")
    run = make_run("EXECUTING")
    add_step(run, "a", 0, handle_id=handle_id, status="running")
    url = f"/runs/{run.pk}/log?step=a&stream=stdout"

    response = client_for.get(url + "&offset=0")
    assert response.status_code == 200
    assert response.content == data
    assert response["X-Log-Offset"] == str(len(data))
    assert response["X-Step-Running"] == "1"
    assert response["Content-Type"].startswith("text/plain")

    rest = client_for.get(url + f"&offset={len(data)}")
    assert (rest.status_code, rest.content, rest["X-Log-Offset"]) == (200, b"", str(len(data)))

    middle = client_for.get(url + "&offset=9")
    assert (middle.content, middle["X-Log-Offset"]) == (data[9:], str(len(data)))

    more = b"line three\n"
    with open(path / "stdout.log", "ab") as fh:
        fh.write(more)
    grown = client_for.get(url + f"&offset={len(data)}")
    assert (grown.content, grown["X-Log-Offset"]) == (more, str(len(data) + len(more)))

    stderr = client_for.get(f"/runs/{run.pk}/log?step=a&stream=stderr&offset=0")
    assert (stderr.content, stderr["X-Log-Offset"]) == (b"oops\n", "5")


def test_a_log_offset_past_the_end_starts_over(client_for, make_run, log_dir):
    handle_id, path = log_dir
    (path / "stdout.log").write_bytes(b"new attempt\n")
    run = make_run("EXECUTING")
    add_step(run, "a", 0, handle_id=handle_id, status="running")
    response = client_for.get(f"/runs/{run.pk}/log?step=a&stream=stdout&offset=5000")
    assert (response.content, response["X-Log-Offset"]) == (b"new attempt\n", "12")


def test_x_step_running_is_0_for_a_finished_step_or_run(client_for, make_run, log_dir):
    handle_id, path = log_dir
    (path / "stdout.log").write_bytes(b"done\n")
    run = make_run("EXECUTING")
    add_step(run, "done", 0, handle_id=handle_id, status="success")
    add_step(run, "next", 1, "done", status="pending")
    finished = make_run("CLOSED_CANCELLED", closing_cause="cancelled")
    add_step(finished, "left", 0, status="running")
    assert client_for.get(f"/runs/{run.pk}/log?step=done")["X-Step-Running"] == "0"
    assert client_for.get(f"/runs/{run.pk}/log?step=done").content == b"done\n"
    assert client_for.get(f"/runs/{run.pk}/log?step=next")["X-Step-Running"] == "1"
    left = client_for.get(f"/runs/{finished.pk}/log?step=left")
    assert (left.status_code, left.content, left["X-Step-Running"], left["X-Log-Offset"]) == (200, b"", "0", "0")


def test_the_log_of_an_unknown_step_is_404(client_for, make_run):
    run = make_run("EXECUTING")
    add_step(run, "a", 0)
    other = make_run("EXECUTING")
    add_step(other, "b", 0)
    assert client_for.get(f"/runs/{run.pk}/log?step=nope").status_code == 404
    assert client_for.get(f"/runs/{run.pk}/log").status_code == 404
    assert client_for.get(f"/runs/{run.pk}/log?step=b").status_code == 404  # another run's step
    assert client_for.get(f"/runs/{run.pk}/log?step=a").status_code == 200
