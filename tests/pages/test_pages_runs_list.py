"""The runs list and its row endpoint, through Django's test client: the
state, search, agent and since filters, 50 runs a page, one row or 204
when it is filtered out, the state badge's display group, and odd filter
values that are not server errors."""

import re

import pytest
from django.test import Client
from django.utils import timezone

from runs.models import Run
from tests.conftest import make_user
from tests.pages.pages_helpers import html_of, row_ids, run_in

pytestmark = pytest.mark.django_db


# --- the runs list --------------------------------------------------------------


def test_the_list_filters_by_state(client_for, make_run):
    created = make_run("CREATED")
    succeeded = make_run("SUCCEEDED")
    failed = make_run("CLOSED_FAILED", closing_cause="failed")
    assert row_ids(html_of(client_for.get("/runs/"))) == [failed.pk, succeeded.pk, created.pk]
    html = html_of(client_for.get("/runs/?state=SUCCEEDED"))
    assert row_ids(html) == [succeeded.pk]
    assert '<option value="SUCCEEDED" selected>' in html
    assert "1 run matching the filters" in html
    assert row_ids(html_of(client_for.get("/runs/?state=AWAITING_HITL"))) == []
    assert 'id="runs-empty"' in html_of(client_for.get("/runs/?state=AWAITING_HITL"))
    # An unknown state is ignored, not an error.
    assert row_ids(html_of(client_for.get("/runs/?state=DANCING"))) == [failed.pk, succeeded.pk, created.pk]


def test_the_list_searches_by_id_and_by_title(client_for, make_run):
    deploy_web = make_run("CREATED", title="Deploy web")
    backup = make_run("SUCCEEDED", title="backup db")
    deploy_api = make_run("EXECUTING", title="redeploy api")
    assert row_ids(html_of(client_for.get(f"/runs/?q={backup.pk}"))) == [backup.pk]
    assert row_ids(html_of(client_for.get("/runs/?q=deploy"))) == [deploy_api.pk, deploy_web.pk]
    assert row_ids(html_of(client_for.get("/runs/?q=DB"))) == [backup.pk]
    assert row_ids(html_of(client_for.get("/runs/?q=nothing-like-this"))) == []
    assert row_ids(html_of(client_for.get("/runs/?q=deploy&state=CREATED"))) == [deploy_web.pk]


def test_the_agent_filter_lists_the_tenants_submitters_and_filters_by_them(client_for, tenant, agent, other_tenant,
                                                                          outsider, make_run):
    bob = make_user("bob", tenant)
    by_agent = make_run("CREATED")
    by_bob = make_run("CREATED")
    Run.objects.filter(pk=by_bob.pk).update(submitted_by=bob)
    run_in(other_tenant, outsider)
    html = html_of(client_for.get("/runs/"))
    select = re.search(r'<select id="f-agent" name="agent">(.*?)</select>', html, re.S).group(1)
    assert re.findall(r'<option value="(\d*)"[^>]*>([^<]*)</option>', select) == [
        ("", "any"), (str(agent.pk), "agent"), (str(bob.pk), "bob")]
    html = html_of(client_for.get(f"/runs/?agent={bob.pk}"))
    assert row_ids(html) == [by_bob.pk]
    assert f'<option value="{bob.pk}" selected>bob</option>' in html
    assert row_ids(html_of(client_for.get(f"/runs/?agent={agent.pk}"))) == [by_agent.pk]


def test_the_since_filter(client_for, make_run):
    recent = make_run("CREATED")
    old = make_run("CREATED")
    Run.objects.filter(pk=old.pk).update(created_at=timezone.now() - timezone.timedelta(days=2))
    assert row_ids(html_of(client_for.get("/runs/?since=1h"))) == [recent.pk]
    assert row_ids(html_of(client_for.get("/runs/?since=24h"))) == [recent.pk]
    assert row_ids(html_of(client_for.get("/runs/?since=7d"))) == [old.pk, recent.pk]


def test_the_list_has_50_runs_a_page(client_for, make_run):
    runs = [make_run("CREATED") for _ in range(51)]
    first = html_of(client_for.get("/runs/"))
    assert row_ids(first) == [run.pk for run in reversed(runs[1:])]
    assert "51 runs" in first and "Page 1 of 2" in first
    assert 'href="?page=2" rel="next"' in first
    second = html_of(client_for.get("/runs/?page=2"))
    assert row_ids(second) == [runs[0].pk]
    assert "Page 2 of 2" in second and 'href="?page=1" rel="prev"' in second
    filtered = html_of(client_for.get("/runs/?state=CREATED"))
    assert 'href="?state=CREATED&amp;page=2" rel="next"' in filtered


def test_the_row_endpoint_returns_one_row_or_204_when_filtered_out(client_for, make_run):
    run = make_run("EXECUTING", title="the-row")
    response = client_for.get(f"/runs/{run.pk}/row/")
    assert response.status_code == 200
    html = html_of(response).strip()
    assert html.startswith(f'<tr id="run-{run.pk}" data-run="{run.pk}">') and html.endswith("</tr>")
    assert "<main" not in html and "<html" not in html
    assert "the-row" in html
    assert client_for.get(f"/runs/{run.pk}/row/?state=EXECUTING").status_code == 200
    assert client_for.get(f"/runs/{run.pk}/row/?q=the-row").status_code == 200
    filtered_out = client_for.get(f"/runs/{run.pk}/row/?state=SUCCEEDED")
    assert (filtered_out.status_code, filtered_out.content) == (204, b"")
    assert client_for.get(f"/runs/{run.pk}/row/?q=other").status_code == 204
    assert client_for.get(f"/runs/{run.pk + 1000}/row/").status_code == 404


@pytest.mark.parametrize(("state", "group"), [
    ("CREATED", "main"), ("PLANNING", "main"), ("EXECUTING", "main"), ("AWAITING_HITL", "waiting"),
    ("FAILED", "transient"), ("CANCELLED", "transient"), ("TRACING", "transient"),
    ("SUCCEEDED", "succeeded"), ("CLOSED_REJECTED", "closed-rejected"), ("CLOSED_FAILED", "closed-failed"),
    ("CLOSED_CANCELLED", "closed-cancelled"),
])
def test_the_state_badge_has_its_display_group_class(client_for, make_run, state, group):
    run = make_run(state)
    badge = f'<span class="badge badge-{group}" data-state="{state}">{state}</span>'
    row = html_of(client_for.get(f"/runs/{run.pk}/row/"))
    assert badge in row
    assert badge in html_of(client_for.get("/runs/"))
    assert badge in html_of(client_for.get(f"/runs/{run.pk}/"))



def test_a_search_for_a_non_decimal_digit_is_a_title_search(make_run, tenant):
    run = make_run("CREATED", title="x²")
    client = Client(raise_request_exception=False)
    client.force_login(make_user("alice", tenant))
    response = client.get("/runs/?q=%C2%B2")
    assert response.status_code == 200
    assert row_ids(html_of(response)) == [run.pk]
    assert client.get(f"/runs/{run.pk}/row/?q=%C2%B2").status_code == 200


def test_an_out_of_range_agent_filter_is_not_a_server_error(make_run, tenant):
    run = make_run("CREATED")
    client = Client(raise_request_exception=False)
    client.force_login(make_user("alice", tenant))
    huge = "9" * 25
    assert client.get(f"/runs/?agent={huge}").status_code == 200
    assert client.get(f"/runs/{run.pk}/row/?agent={huge}").status_code in (200, 204)
