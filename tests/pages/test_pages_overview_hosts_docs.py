"""The overview, the hosts page and the API docs, through Django's test
client: the overview's two charts and state counts, each host's ledger
(or none yet), and API docs that load their assets from /static/ only."""

import re

import pytest

from runtime.ledger import host_register
from runtime.models import HostCapacity
from tests.pages.pages_helpers import html_of, state_counts, tags

pytestmark = pytest.mark.django_db


# --- overview, hosts, API docs -----------------------------------------------------


def test_the_overview_shows_two_charts_and_the_state_counts(client_for, make_run):
    for state in ("SUCCEEDED", "SUCCEEDED", "CLOSED_FAILED", "AWAITING_HITL", "EXECUTING", "EXECUTING", "EXECUTING"):
        make_run(state, title=f"overview-{state.lower()}")
    html = html_of(client_for.get("/"))
    charts = [svg for svg in tags(html, "svg") if "chart" in svg.get("class", "").split()]
    assert [svg["class"] for svg in charts] == ["chart chart-bars", "chart chart-lines"]
    assert all(svg.get("role") == "img" for svg in charts)
    counts = state_counts(html)
    assert (counts["SUCCEEDED"], counts["CLOSED_FAILED"], counts["AWAITING_HITL"], counts["EXECUTING"],
            counts["CREATED"]) == (2, 1, 1, 3, 0)
    assert "overview-awaiting_hitl" in html  # the runs waiting for a human are listed
    assert "overview-closed_failed" in html  # and the recent failures


def test_the_hosts_page_shows_each_hosts_ledger(client_for):
    host_register("test-host", task_slots=2, memory_bytes=1 << 30, pids=100, capabilities={})
    HostCapacity.objects.filter(host="test-host").update(task_slots_reserved=1, memory_bytes_reserved=256 << 20,
                                                         pids_reserved=30)
    response = client_for.get("/hosts/")
    assert response.status_code == 200
    html = html_of(response).replace("\xa0", " ")
    assert '<h2 id="host-1" style="margin-top:0">test-host</h2>' in html
    ledger = dict(re.findall(r'<tr><th scope="row">([^<]+)</th>(<td>.*?</td>)</tr>', html))
    cells = {name: re.findall(r"<td>([^<]*)</td>", row) for name, row in ledger.items()}
    assert cells == {"Task slots": ["2", "1", "1"], "Memory": ["1.0 GB", "256.0 MB", "768.0 MB"],
                     "Processes": ["100", "30", "70"]}


def test_the_hosts_page_without_hosts(client_for):
    HostCapacity.objects.all().delete()
    assert "No worker has announced itself yet" in html_of(client_for.get("/hosts/"))


def test_the_api_docs_load_their_assets_from_static_only(client_for):
    response = client_for.get("/api/v1/docs/")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/html")
    html = html_of(response)
    urls = [attrs["src"] for attrs in tags(html, "script") if "src" in attrs]
    urls += [attrs["href"] for attrs in tags(html, "link") if "href" in attrs]
    assert urls, "the docs page loads no script or stylesheet"
    assert all(url.startswith("/static/") for url in urls), urls
    assert not [url for url in urls if "http://" in url or "https://" in url]
