"""Cancel and retry from the run page, through Django's test client: CSRF on
the writes; a cancel applied at once to a waiting run, only recorded for a
run before execution, refused for a final run; GET refused; a retry of a
final run creates a new run and opens it, of any other run is refused."""

import re

import pytest

from runs.models import AuditLog, Run
from tests.conftest import make_user
from tests.pages.pages_helpers import html_of, signed_in

pytestmark = pytest.mark.django_db


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
