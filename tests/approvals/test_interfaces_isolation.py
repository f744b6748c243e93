"""Tenant isolation of the approvals' API and pages over a hundred ids:
another tenant's requests and ids that exist nowhere get the same 404 (no
existence oracle), and nothing is decided."""

import re

import pytest

from approvals.models import ApprovalRequest, Decision
from runs.models import Run
from tests.approvals.interfaces_helpers import error_of, signed_in, waiting_run
from tests.conftest import open_approval, token_client

pytestmark = pytest.mark.django_db


# --- tenant isolation over a hundred ids -----------------------------------------------


def test_another_tenants_ids_and_missing_ids_are_uniform_404s(make_run, outsider):
    theirs = [open_approval(waiting_run(make_run)).pk for _ in range(100)]
    missing = list(range(max(theirs) + 1000, max(theirs) + 1100))
    assert not ApprovalRequest.objects.filter(pk__in=missing).exists()
    api = token_client(outsider)
    page = signed_in(outsider)

    bodies: dict[str, set[str]] = {"detail": set(), "approve": set(), "reject": set(), "page": set()}
    for request_id in theirs + missing:
        for name, response in (
            ("detail", api.get(f"/api/v1/approvals/{request_id}")),
            ("approve", api.post(f"/api/v1/approvals/{request_id}/approve", {"comment": "x"}, format="json")),
            ("reject", api.post(f"/api/v1/approvals/{request_id}/reject", {"comment": "x"}, format="json")),
        ):
            error_of(response, 404, "not_found")
            bodies[name].add(response.content.decode().replace(f"no approval request {request_id}\"", "<id>"))
        response = page.get(f"/approvals/{request_id}/")
        assert response.status_code == 404, (request_id, response.status_code)
        # The page's masked CSRF token (of the logout form) differs on every render.
        bodies["page"].add(re.sub(r'name="csrfmiddlewaretoken" value="[^"]+"', "csrf",
                                  response.content.decode()))
        response = page.post(f"/approvals/{request_id}/approve", {"comment": "x"})
        assert response.status_code == 404, (request_id, response.status_code)
        response = page.post(f"/approvals/{request_id}/reject", {"comment": "x"})
        assert response.status_code == 404, (request_id, response.status_code)

    # One body per endpoint, whether the id exists in another tenant or nowhere.
    assert {name: len(variants) for name, variants in bodies.items()} == {name: 1 for name in bodies}, bodies
    assert Decision.objects.count() == 0
    assert set(ApprovalRequest.objects.values_list("status", flat=True)) == {"pending"}
    assert set(Run.objects.filter(approval_requests__pk__in=theirs).values_list("state", flat=True)) == {
        "AWAITING_HITL"}
    assert api.get("/api/v1/approvals?status=pending").json() == []
