"""The layout every server-rendered page shares, through Django's test
client: a title, one main, a labelled nav and the user's name and tenant;
the admin link for staff only; the approvals link, with the count of the
tenant's pending requests, for approvers only."""

import re

import pytest

from runs.models import Run
from tests.conftest import make_user, open_approval
from tests.pages.pages_helpers import html_of, run_in, signed_in, tags

pytestmark = pytest.mark.django_db


# --- the layout every page shares --------------------------------------------


def page_urls(run: Run) -> list[str]:
    return ["/", "/runs/", f"/runs/{run.pk}/", "/hosts/"]


def test_every_page_has_title_main_nav_and_the_users_name_and_tenant(client_for, make_run):
    run = make_run("EXECUTING")
    for url in page_urls(run):
        response = client_for.get(url)
        assert response.status_code == 200, url
        html = html_of(response)
        assert re.search(r"<title>[^<]*\S[^<]* · ExecGo</title>", html), url
        assert len(tags(html, "main")) == 1, url
        assert any(nav.get("aria-label") for nav in tags(html, "nav")), url
        assert "<span>alice · acme</span>" in html, url


def test_the_admin_link_appears_only_for_staff(tenant, make_run):
    run = make_run("EXECUTING")
    staff = make_user("root", tenant)
    staff.is_staff = True
    staff.save()
    plain = make_user("plain", tenant)
    for url in page_urls(run):
        assert 'href="/admin/"' in html_of(signed_in(staff).get(url)), url
        assert 'href="/admin/"' not in html_of(signed_in(plain).get(url)), url


def test_the_approvals_link_and_its_count_appear_only_for_approvers(tenant, other_tenant, outsider, make_run):
    run = make_run("AWAITING_HITL")
    open_approval(run)
    open_approval(make_run("AWAITING_HITL"))
    make_run("EXECUTING")
    open_approval(run_in(other_tenant, outsider, "AWAITING_HITL"))  # not counted: another tenant's
    approver = make_user("ann", tenant, groups=("approvers",))
    plain = make_user("plain", tenant, groups=("agents",))
    for url in page_urls(run):
        html = html_of(signed_in(approver).get(url))
        assert 'href="/approvals/"' in html, url
        assert re.search(r'<span class="count" id="pending-approvals" aria-label="2 pending">2</span>', html), url
        html = html_of(signed_in(plain).get(url))
        assert "pending-approvals" not in html and "Approvals" not in html, url


def test_the_approvals_count_follows_the_tenants_pending_requests(tenant, make_run):
    approver = make_user("ann", tenant, groups=("approvers",))
    client = signed_in(approver)
    assert 'aria-label="0 pending">0</span>' in html_of(client.get("/runs/"))
    for _ in range(3):
        open_approval(make_run("AWAITING_HITL"))
    assert 'aria-label="3 pending">3</span>' in html_of(client.get("/runs/"))
