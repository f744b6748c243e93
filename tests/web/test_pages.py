"""The server-rendered pages, through Django's test client: sign-in and its
rate limit, the layout every page shares, tenant isolation, CSRF on the
writes, the runs list and its row endpoint, the run page, the log tail, the
overview, the hosts page, the API docs' assets, and query counts."""

import re
import shutil
import uuid
from html.parser import HTMLParser
from urllib.parse import quote

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from runs.models import AuditLog, Job, Run, Step, Trace, TraceKind
from runtime.ledger import host_register
from runtime.models import HostCapacity
from tests.conftest import make_user, open_approval

pytestmark = pytest.mark.django_db

HOSTILE = "<script>alert(1)</script>"
ESCAPED_HOSTILE = "&lt;script&gt;alert(1)&lt;/script&gt;"


# --- helpers -----------------------------------------------------------------


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, {name: value or "" for name, value in attrs}))

    handle_startendtag = handle_starttag


def tags(html: str, name: str) -> list[dict[str, str]]:
    """The attributes of every ``<name>`` start tag of the page."""
    parser = _Tags()
    parser.feed(html)
    return [attrs for tag, attrs in parser.tags if tag == name]


def html_of(response) -> str:
    return response.content.decode()


def row_ids(html: str) -> list[int]:
    return [int(pk) for pk in re.findall(r'<tr id="run-(\d+)"', html)]


def signed_in(user, **kwargs) -> Client:
    client = Client(**kwargs)
    client.force_login(user)
    return client


def run_in(tenant, user, state: str = "CREATED", **fields) -> Run:
    """A run of another tenant than the ``make_run`` factory's."""
    job = Job.objects.create(tenant=tenant, created_by=user)
    run = Run.objects.create(job=job, tenant=tenant, submitted_by=user, state=state, plan={"steps": []},
                             timeout_s=600, approval_timeout_s=3600, last_state_change_at=timezone.now(), **fields)
    Job.objects.filter(pk=job.pk).update(latest_run=run)
    return run


def add_step(run: Run, step_id: str, position: int, *depends_on: str, **fields) -> Step:
    return Step.objects.create(run=run, step_id=step_id, position=position, tool="shell",
                               params={"argv": ["true"]}, depends_on=list(depends_on), timeout_s=5, **fields)


def login_redirect(url: str) -> str:
    return "/accounts/login/?next=" + quote(url, safe="/")


def state_counts(html: str) -> dict[str, int]:
    return {state: int(n) for state, n in re.findall(r'data-state="(\w+)"><div class="n">(\d+)</div>', html)}


@pytest.fixture
def user(tenant):
    return make_user("alice", tenant)


@pytest.fixture
def client_for(user):
    return signed_in(user)


@pytest.fixture
def outsider(other_tenant):
    return make_user("outsider", other_tenant)


@pytest.fixture
def log_dir(settings):
    """A fresh task directory under EXECGO_TASKS_DIR, removed afterwards."""
    handle_id = f"h-test-{uuid.uuid4().hex[:12]}"
    path = settings.EXECGO_TASKS_DIR / handle_id
    path.mkdir(parents=True)
    yield handle_id, path
    shutil.rmtree(path, ignore_errors=True)


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


# --- CSRF and the writes -------------------------------------------------------


def csrf_token_of_form(html: str, action: str) -> str:
    match = re.search(rf'<form method="post" action="{re.escape(action)}">'
                      r'<input type="hidden" name="csrfmiddlewaretoken" value="([^"]+)">', html)
    assert match, f"no form posting to {action}"
    return match.group(1)


def test_cancel_without_a_csrf_token_is_403_and_changes_nothing(user, make_run):
    run = make_run("AWAITING_HITL")
    client = signed_in(user, enforce_csrf_checks=True)
    client.get(f"/runs/{run.pk}/")  # the page sets the CSRF cookie
    response = client.post(f"/runs/{run.pk}/cancel")
    assert response.status_code == 403
    run.refresh_from_db()
    assert (run.state, run.cancel_requested_at) == ("AWAITING_HITL", None)
    assert not AuditLog.objects.filter(run_id=run.pk, event="cancel_requested").exists()


def test_cancel_with_the_pages_csrf_token_closes_a_waiting_run(user, make_run, django_capture_on_commit_callbacks):
    run = make_run("AWAITING_HITL")
    client = signed_in(user, enforce_csrf_checks=True)
    page = client.get(f"/runs/{run.pk}/")
    token = csrf_token_of_form(html_of(page), f"/runs/{run.pk}/cancel")
    with django_capture_on_commit_callbacks(execute=False):  # nothing is sent to the broker
        response = client.post(f"/runs/{run.pk}/cancel", {"csrfmiddlewaretoken": token})
    assert response.status_code == 302
    assert response["Location"] == f"/runs/{run.pk}/"
    run.refresh_from_db()
    assert run.cancel_requested_at is not None
    assert run.cancel_requested_by_id == user.pk
    # AWAITING_HITL has a CANCELLED edge and nobody else drives it: applied at once.
    assert (run.state, run.closing_cause) == ("CLOSED_CANCELLED", "cancelled")
    assert AuditLog.objects.filter(run_id=run.pk, event="cancel_requested", actor=user).count() == 1
    assert AuditLog.objects.filter(run_id=run.pk, event="run_cancelled").count() == 1
    html = html_of(client.get(response["Location"]))
    assert f"Cancel requested for run {run.pk}." in html
    assert 'id="retry-run"' in html and 'id="cancel-run"' not in html


def test_cancel_of_a_run_before_execution_only_records_the_request(client_for, user, make_run):
    run = make_run("PLANNING")
    response = client_for.post(f"/runs/{run.pk}/cancel")
    assert response.status_code == 302
    run.refresh_from_db()
    assert run.state == "PLANNING"
    assert run.cancel_requested_at is not None and run.cancel_requested_by_id == user.pk


@pytest.mark.django_db(transaction=True)  # the refusal is audited outside the request's transaction
def test_cancel_of_a_final_run_shows_an_error(tenant, make_run):
    run = make_run("SUCCEEDED")
    client = signed_in(make_user("alice", tenant))
    response = client.post(f"/runs/{run.pk}/cancel", follow=True)
    assert response.status_code == 200
    assert f"run {run.pk} is already SUCCEEDED; nothing to cancel" in html_of(response)
    run.refresh_from_db()
    assert (run.state, run.cancel_requested_at) == ("SUCCEEDED", None)


def test_get_on_cancel_and_retry_is_405(client_for, make_run):
    run = make_run("AWAITING_HITL")
    for url in [f"/runs/{run.pk}/cancel", f"/runs/{run.pk}/retry"]:
        assert client_for.get(url).status_code == 405, url
    run.refresh_from_db()
    assert (run.state, run.cancel_requested_at) == ("AWAITING_HITL", None)
    assert Run.objects.count() == 1


def test_retry_of_a_final_run_creates_a_new_run_and_opens_it(client_for, make_run,
                                                              django_capture_on_commit_callbacks):
    old = make_run("CLOSED_FAILED", closing_cause="failed", title="nightly")
    # The new run's advance is sent after commit: captured here, never sent,
    # so no task is left in the broker for a later worker.
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = client_for.post(f"/runs/{old.pk}/retry")
    assert callbacks
    new = Run.objects.exclude(pk=old.pk).get()
    assert response.status_code == 302
    assert response["Location"] == f"/runs/{new.pk}/"
    assert (new.retry_of_id, new.job_id, new.state, new.title, new.plan) == (old.pk, old.job_id, "CREATED",
                                                                          "nightly", old.plan)
    old.refresh_from_db()
    assert old.state == "CLOSED_FAILED"
    html = html_of(client_for.get(response["Location"]))
    assert f"Run {new.pk} retries run {old.pk}." in html
    assert f'<a href="/runs/{old.pk}/">run #{old.pk}</a>' in html


def test_retry_of_a_run_that_is_not_final_shows_an_error_and_creates_nothing(client_for, make_run):
    run = make_run("EXECUTING")
    response = client_for.post(f"/runs/{run.pk}/retry")
    assert (response.status_code, response["Location"]) == (302, f"/runs/{run.pk}/")
    assert Run.objects.count() == 1
    html = html_of(client_for.get(response["Location"]))
    assert re.search(r'<li class="error">run \d+ is EXECUTING; only a final run can be retried</li>', html)


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
