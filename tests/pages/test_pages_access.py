"""Who may see the server-rendered pages, through Django's test client: an
anonymous visitor is sent to the login page and changes nothing; the
login form, its rate limit and logout; and tenant isolation: another
tenant's run is 404 everywhere and stays unchanged, the runs list and
the overview show only the user's tenant, and a user without a tenant
sees empty pages."""

import re
from urllib.parse import quote

import pytest
from django.contrib.auth.models import User
from django.test import Client

from runs.models import AuditLog, Run
from tests.conftest import make_user
from tests.pages.pages_helpers import add_step, html_of, row_ids, run_in, signed_in, state_counts, tags

pytestmark = pytest.mark.django_db


def login_redirect(url: str) -> str:
    return "/accounts/login/?next=" + quote(url, safe="/")


# --- anonymous visitors ------------------------------------------------------


def test_anonymous_get_of_every_page_redirects_to_login(make_run):
    run = make_run("EXECUTING")
    add_step(run, "a", 0)
    client = Client()
    for url in ["/", "/runs/", "/runs/?state=EXECUTING", f"/runs/{run.pk}/", f"/runs/{run.pk}/?fragment=live",
                f"/runs/{run.pk}/row/", f"/runs/{run.pk}/log?step=a&stream=stdout&offset=0", "/hosts/"]:
        response = client.get(url)
        assert response.status_code == 302, url
        assert response["Location"] == login_redirect(url), url


def test_anonymous_post_cancel_and_retry_change_nothing(make_run):
    waiting = make_run("AWAITING_HITL")
    failed = make_run("CLOSED_FAILED", closing_cause="failed")
    client = Client()
    for url in [f"/runs/{waiting.pk}/cancel", f"/runs/{failed.pk}/retry"]:
        response = client.post(url)
        assert response.status_code == 302
        assert response["Location"].startswith("/accounts/login/?next=")
    waiting.refresh_from_db()
    assert (waiting.state, waiting.cancel_requested_at) == ("AWAITING_HITL", None)
    assert Run.objects.count() == 2
    assert not AuditLog.objects.filter(event__in=["cancel_requested", "run_created"]).exists()


# --- login and logout --------------------------------------------------------


def test_login_page_has_a_title_labelled_inputs_and_a_csrf_token():
    response = Client().get("/accounts/login/")
    assert response.status_code == 200
    html = html_of(response)
    assert re.search(r"<title>\s*Log in · ExecGo\s*</title>", html)
    inputs = {attrs.get("name"): attrs for attrs in tags(html, "input")}
    labels = {attrs.get("for") for attrs in tags(html, "label")}
    assert inputs["username"]["id"] in labels
    assert inputs["password"]["id"] in labels
    assert inputs["password"]["type"] == "password"
    assert inputs["csrfmiddlewaretoken"]["type"] == "hidden" and len(inputs["csrfmiddlewaretoken"]["value"]) >= 32
    assert [form.get("method") for form in tags(html, "form")] == ["post"]


def test_an_approver_who_is_not_staff_logs_in_and_sees_the_overview(tenant):
    make_user("ann", tenant, groups=("approvers",))
    client = Client()
    response = client.post("/accounts/login/", {"username": "ann", "password": "pw-ann"})
    assert response.status_code == 302
    assert response["Location"] == "/"
    overview = client.get("/")
    assert overview.status_code == 200
    html = html_of(overview)
    assert "<h1>Overview</h1>" in html
    assert "<span>ann · acme</span>" in html
    assert 'href="/admin/"' not in html


def test_login_follows_next_to_the_page_asked_for(tenant):
    make_user("ann", tenant)
    response = Client().post("/accounts/login/", {"username": "ann", "password": "pw-ann", "next": "/hosts/"})
    assert (response.status_code, response["Location"]) == (302, "/hosts/")


def test_a_wrong_password_shows_an_error_and_stays_on_the_page(tenant):
    make_user("ann", tenant)
    client = Client()
    response = client.post("/accounts/login/", {"username": "ann", "password": "nope"})
    assert response.status_code == 200
    html = html_of(response)
    assert 'class="errorlist" role="alert"' in html
    assert "Please enter a correct username and password" in html
    assert "_auth_user_id" not in client.session
    assert client.get("/").status_code == 302


def test_too_many_failures_lock_the_username_out_even_with_the_right_password(settings, tenant):
    settings.AXES_FAILURE_LIMIT = 3
    make_user("ann", tenant)
    make_user("bob", tenant)
    client = Client()
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        assert client.post("/accounts/login/", {"username": "ann", "password": "wrong"}).status_code == 200
    client.post("/accounts/login/", {"username": "ann", "password": "wrong"})  # the limit-th failure

    locked = client.post("/accounts/login/", {"username": "ann", "password": "pw-ann"})
    assert locked.status_code == 429
    assert "Too many failed logins" in html_of(locked)
    assert "after 3 failed attempts" in html_of(locked)
    assert "_auth_user_id" not in client.session
    assert client.get("/").status_code == 302
    # The lock is on that username (from that address): another user still gets in.
    other = Client()
    assert other.post("/accounts/login/", {"username": "bob", "password": "pw-bob"}).status_code == 302


def test_failures_below_the_limit_do_not_lock_the_user_out(settings, tenant):
    settings.AXES_FAILURE_LIMIT = 3
    make_user("ann", tenant)
    client = Client()
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        client.post("/accounts/login/", {"username": "ann", "password": "wrong"})
    assert client.post("/accounts/login/", {"username": "ann", "password": "pw-ann"}).status_code == 302


def test_logout_is_a_post_and_ends_the_session(client_for):
    assert client_for.get("/").status_code == 200
    assert client_for.get("/accounts/logout/").status_code == 405
    assert client_for.get("/").status_code == 200  # a GET did not log out
    response = client_for.post("/accounts/logout/")
    assert response.status_code == 302
    assert response["Location"] == "/accounts/login/"
    after = client_for.get("/")
    assert (after.status_code, after["Location"]) == (302, login_redirect("/"))


# --- tenant isolation --------------------------------------------------------


def test_another_tenants_run_is_404_everywhere_and_stays_unchanged(outsider, make_run):
    waiting = make_run("AWAITING_HITL", title="acme-secret-waiting")
    failed = make_run("CLOSED_FAILED", closing_cause="failed", title="acme-secret-failed")
    add_step(waiting, "a", 0)
    client = signed_in(outsider)
    for run in (waiting, failed):
        for url in [f"/runs/{run.pk}/", f"/runs/{run.pk}/?fragment=live", f"/runs/{run.pk}/row/",
                    f"/runs/{run.pk}/log?step=a&stream=stdout&offset=0"]:
            response = client.get(url)
            assert response.status_code == 404, url
            assert "acme-secret" not in html_of(response), url
        for url in [f"/runs/{run.pk}/cancel", f"/runs/{run.pk}/retry"]:
            assert client.post(url).status_code == 404, url
    waiting.refresh_from_db()
    failed.refresh_from_db()
    assert (waiting.state, waiting.cancel_requested_at) == ("AWAITING_HITL", None)
    assert (failed.state, failed.cancel_requested_at) == ("CLOSED_FAILED", None)
    assert Run.objects.count() == 2
    assert not AuditLog.objects.filter(event__in=["cancel_requested", "run_created"]).exists()


def test_the_runs_list_shows_only_the_users_tenant(other_tenant, outsider, make_run):
    ours = [make_run("CREATED", title="acme-alpha"), make_run("SUCCEEDED", title="acme-beta")]
    theirs = run_in(other_tenant, outsider, "CREATED", title="globex-gamma")
    html = html_of(signed_in(outsider).get("/runs/"))
    assert row_ids(html) == [theirs.pk]
    assert "globex-gamma" in html
    for run in ours:
        assert f'id="run-{run.pk}"' not in html and f'href="/runs/{run.pk}/"' not in html
    assert "acme-alpha" not in html and "acme-beta" not in html
    assert ">agent</option>" not in html  # the other tenant's submitter is not in the agent filter
    # and the other way round
    html = html_of(signed_in(make_user("alice", ours[0].tenant)).get("/runs/"))
    assert row_ids(html) == [ours[1].pk, ours[0].pk]
    assert "globex-gamma" not in html


def test_the_overview_counts_only_the_users_tenant(client_for, other_tenant, outsider, make_run):
    make_run("SUCCEEDED")
    make_run("SUCCEEDED")
    make_run("EXECUTING")
    for state in ("SUCCEEDED", "SUCCEEDED", "SUCCEEDED", "EXECUTING", "AWAITING_HITL", "CLOSED_FAILED"):
        run_in(other_tenant, outsider, state, title="globex-run")
    html = html_of(client_for.get("/"))
    counts = state_counts(html)
    assert len(counts) == 15
    assert {state: n for state, n in counts.items() if n} == {"SUCCEEDED": 2, "EXECUTING": 1}
    assert "globex-run" not in html
    theirs = state_counts(html_of(signed_in(outsider).get("/")))
    assert {state: n for state, n in theirs.items() if n} == {"SUCCEEDED": 3, "EXECUTING": 1, "AWAITING_HITL": 1,
                                                               "CLOSED_FAILED": 1}


def test_a_user_without_a_tenant_sees_empty_pages(make_run):
    run = make_run("AWAITING_HITL")
    loner = signed_in(User.objects.create_user("loner", password="pw"))
    assert row_ids(html_of(loner.get("/runs/"))) == []
    assert not any(state_counts(html_of(loner.get("/"))).values())
    assert loner.get(f"/runs/{run.pk}/").status_code == 404
    assert loner.get(f"/runs/{run.pk}/row/").status_code == 404
    assert loner.post(f"/runs/{run.pk}/cancel").status_code == 404
    run.refresh_from_db()
    assert run.cancel_requested_at is None
