"""What an authenticated API request costs the database: the token is read
with its user, membership and tenant in one query (the log line's tenant is
bound from it), then the view's own reads."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tests.conftest import token_client

pytestmark = pytest.mark.django_db


def test_a_read_of_a_missing_run_is_two_queries(agent):
    api = token_client(agent)
    api.get("/api/v1/runs")  # the token's once-a-minute use stamp is written by the first request
    with CaptureQueriesContext(connection) as queries:
        assert api.get("/api/v1/runs/999999").status_code == 404
    tables = [query["sql"].split(" FROM ", 1)[1].split()[0] for query in queries.captured_queries]
    assert tables == ['"runs_apitoken"', '"runs_run"'], [q["sql"][:120] for q in queries.captured_queries]


def test_a_read_of_a_run_reads_no_membership_or_tenant_of_its_own(agent, make_run):
    api = token_client(agent)
    run = make_run("CREATED")
    api.get("/api/v1/runs")
    with CaptureQueriesContext(connection) as first:
        assert api.get(f"/api/v1/runs/{run.pk}").status_code == 200
    assert 'FROM "runs_membership"' not in " ".join(q["sql"] for q in first.captured_queries)
    assert 'FROM "runs_tenant"' not in " ".join(q["sql"] for q in first.captured_queries)
