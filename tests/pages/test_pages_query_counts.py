"""Query counts of the server-rendered pages: the runs list makes as many
queries for 30 runs as for 3, and the run page for 30 steps as for 3."""

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from runs.models import AuditLog, Run, Trace, TraceKind
from tests.pages.pages_helpers import add_step, html_of, row_ids

pytestmark = pytest.mark.django_db


# --- query counts ------------------------------------------------------------------


def count_queries(client: Client, url: str) -> int:
    with CaptureQueriesContext(connection) as queries:
        assert client.get(url).status_code == 200
    return len(queries)


def test_the_runs_list_makes_as_many_queries_for_30_runs_as_for_3(client_for, make_run):
    for _ in range(3):
        make_run("EXECUTING", title="q")
    client_for.get("/runs/")  # warm up
    few = count_queries(client_for, "/runs/")
    for _ in range(27):
        make_run("CLOSED_FAILED", closing_cause="failed", title="q")
    many = count_queries(client_for, "/runs/")
    assert len(row_ids(html_of(client_for.get("/runs/")))) == 30
    assert few == many


def test_the_run_page_makes_as_many_queries_for_30_steps_as_for_3(client_for, tenant, agent, make_run):
    def run_with(count: int) -> Run:
        run = make_run("EXECUTING", cancel_requested_by=agent, cancel_requested_at=timezone.now())
        for index in range(count):
            step = add_step(run, f"s{index}", index, *([f"s{index - 1}"] if index else []))
            Trace.objects.create(run=run, kind=TraceKind.STEP, step=step, data={})
            Trace.objects.create(run=run, kind=TraceKind.TRANSITION, from_state="PLANNING", to_state="EXECUTING",
                                 step=step, data={"caller": "test"})
            AuditLog.objects.create(run=run, tenant=tenant, event="state_changed", actor=agent, caller="api")
        return run

    small, large = run_with(3), run_with(30)
    client_for.get(f"/runs/{small.pk}/")  # warm up
    few = count_queries(client_for, f"/runs/{small.pk}/")
    many = count_queries(client_for, f"/runs/{large.pk}/")
    html = html_of(client_for.get(f"/runs/{large.pk}/"))
    assert html.count('<article class="step"') == 30
    assert html.count("<td>state_changed</td><td>agent</td>") == 30
    assert few == many
