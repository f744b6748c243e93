"""The pages in Debian's Chromium against a live Daphne server and a real
worker: log in, watch runs change live, a log that grows, the DAG, the
charts, cancel from the page, the API docs offline. Screenshots of every
page are saved under var/screenshots/<stack>/."""

import re
import time

import pytest
from playwright.sync_api import expect

from runs.models import Run
from tests.conftest import token_client, wait_for_run, wait_until
from tests.pages.conftest import PASSWORD, log_in, screenshot

pytestmark = pytest.mark.django_db(transaction=True)



def submit(agent, plan: dict, title: str = "") -> int:
    response = token_client(agent).post("/api/v1/runs", {"title": title, "plan": plan}, format="json")
    assert response.status_code == 201, response.content
    return response.json()["id"]


def shell(step_id: str, script: str, **extra) -> dict:
    return {"id": step_id, "tool": "shell", "params": {"script": script}, **extra}


def test_a_run_appears_and_changes_state_live_on_the_runs_page(page, celery_worker, approver, agent):
    log_in(page, "alice", PASSWORD)
    page.goto("/runs/")
    page.wait_for_function("window.execgoLive && window.execgoLive.state === 'live'")
    page.evaluate("window.loadedOnce = true")  # gone if the page reloads

    run_id = submit(agent, {"steps": [shell("one", "sleep 0.3"), shell("two", "true", depends_on=["one"])]},
                    title="watched live")

    row = page.locator(f"#run-{run_id}")
    row.wait_for(timeout=15_000)
    page.locator(f"#run-{run_id} [data-state=SUCCEEDED]").wait_for(timeout=30_000)
    assert page.evaluate("window.loadedOnce") is True
    assert "watched live" in row.inner_text()
    seen = page.evaluate(f"window.execgoLive.events.filter(e => e.run_id === {run_id}).map(e => e.data.to)")
    assert seen == ["PREPARING", "PLANNING", "POLICY_CHECK", "EXECUTING", "TRACING", "SUCCEEDED"] or \
        seen == ["CREATED", "PREPARING", "PLANNING", "POLICY_CHECK", "EXECUTING", "TRACING", "SUCCEEDED"]
    screenshot(page, "runs-list")


def test_a_row_answer_older_than_one_applied_is_dropped(page, approver, make_run):
    """Events of a run come in bursts, and the answers to their row requests
    may come back in any order: the older answer, arriving last, neither
    brings the old state back nor adds a second row."""
    log_in(page, "alice", PASSWORD)
    page.goto("/runs/")
    page.wait_for_function("window.execgoLive && window.execgoLive.state === 'live'")
    run = make_run("EXECUTING", title="answered out of order")  # written directly: no event tells the page
    held = []
    page.route(f"**/runs/{run.pk}/row/**", lambda route: held.append(route))
    page.evaluate(f"window.first = window.execgoLive.refreshRow({run.pk});"
                  f" window.second = window.execgoLive.refreshRow({run.pk}); null")  # not awaited here
    deadline = time.monotonic() + 15
    while len(held) < 2:
        assert time.monotonic() < deadline, f"{len(held)} of the 2 row requests reached the route"
        page.wait_for_timeout(20)  # lets Playwright hand the requests to the route
    older = held[0].fetch()  # the row as it was: EXECUTING
    Run.objects.filter(pk=run.pk).update(state="SUCCEEDED", previous_state="TRACING")
    held[1].fulfill(response=held[1].fetch())
    page.evaluate("window.second")
    held[0].fulfill(response=older)
    page.evaluate("window.first")
    assert page.locator(f"#run-{run.pk}").count() == 1
    expect(page.locator(f"#run-{run.pk}")).to_contain_text("SUCCEEDED")


def test_the_run_page_grows_a_log_draws_the_dag_and_settles(page, celery_worker, approver, agent):
    log_in(page, "alice", PASSWORD)
    run_id = submit(agent, {"steps": [
        shell("ticker", "for i in $(seq 1 15); do echo tick $i; sleep 0.2; done"),
        shell("after-a", "echo a", depends_on=["ticker"]),
        shell("after-b", "echo b", depends_on=["ticker"]),
    ]})
    wait_until(lambda: Run.objects.get(pk=run_id).steps.filter(status="running").exists(), timeout=20,
               what="the ticker running")
    page.goto(f"/runs/{run_id}/")

    log = page.locator("[data-log-step=ticker] pre.log").first
    lengths = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (lengths and "tick 15" in log.inner_text()):
        lengths.append(len(log.inner_text()))
        page.wait_for_timeout(250)
    growth = sorted(set(lengths))
    assert len(growth) >= 3, f"the log did not grow while the step ran: {lengths}"
    assert lengths == sorted(lengths)

    page.locator("#run-live[data-state=SUCCEEDED]").wait_for(timeout=30_000)
    expect(page.locator("svg.dag .dag-node")).to_have_count(3)
    # The live partial may still be settling (htmx swaps attributes in after a moment): expect() waits.
    expect(page.locator("svg.dag .dag-node.step-success")).to_have_count(3)
    expect(page.locator("svg.dag .dag-edge")).to_have_count(2)
    assert "tick 15" in log.inner_text()
    assert page.locator("#timeline-title").is_visible()
    screenshot(page, "run-detail")
    page.set_viewport_size({"width": 390, "height": 844})
    screenshot(page, "run-detail-phone")


def test_cancel_from_the_page_stops_a_long_run(page, celery_worker, approver, agent):
    log_in(page, "alice", PASSWORD)
    run_id = submit(agent, {"steps": [shell("long", "sleep 600", timeout_s=900)]})
    wait_until(lambda: Run.objects.get(pk=run_id).steps.filter(status="running").exists(), timeout=20,
               what="sleep 600 running")
    page.goto(f"/runs/{run_id}/")
    page.get_by_role("button", name="Cancel run").click()

    page.locator("#run-live[data-state=CLOSED_CANCELLED]").wait_for(timeout=30_000)
    run = wait_for_run(run_id, timeout=30)
    assert run.state == "CLOSED_CANCELLED"
    assert run.cancel_requested_by_id == approver.pk
    assert run.steps.get().run_status == "cancelled"
    screenshot(page, "run-cancelled")


def test_every_page_renders_and_is_saved(page, celery_worker, approver, agent):
    run_id = submit(agent, {"steps": [shell("only", "echo hi")]})
    wait_for_run(run_id)
    log_in(page, "alice", PASSWORD)
    screenshot(page, "overview")
    assert page.locator("svg.chart").count() == 2
    assert page.locator("#state-counts [data-state=SUCCEEDED] .n").inner_text() == "1"
    page.goto("/hosts/")
    assert page.locator("main h2").count() >= 1  # the worker announced its host
    screenshot(page, "hosts")
    for width, name in ((390, "phone"), (1280, "laptop")):
        page.set_viewport_size({"width": width, "height": 900})
        page.goto("/runs/")
        assert page.title() == "Runs · ExecGo"
        screenshot(page, f"runs-{name}")
    assert page.request.get("/accounts/logout/").status == 405  # logging out is a POST
    page.goto("/")
    page.get_by_role("button", name="Log out").click()
    page.wait_for_url(re.compile(r".*/accounts/login/.*"))
    screenshot(page, "login")


def test_the_api_docs_render_with_no_network(page, approver):
    outside = []

    def only_this_server(route):
        if route.request.url.startswith(page.context._impl_obj._options.get("baseURL", "")):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    page.route("**/*", only_this_server)
    log_in(page, "alice", PASSWORD)
    page.goto("/api/v1/docs/")
    page.locator(".swagger-ui .info .title").wait_for(timeout=15_000)
    assert "ExecGo API" in page.locator(".swagger-ui .info .title").inner_text()
    assert outside == []
    screenshot(page, "api-docs")
