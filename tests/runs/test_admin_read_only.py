"""What the Django admin may not write: the append-only records (steps,
traces, audit rows, events) cannot be added, changed or deleted, Run.state
is not an input, and a job's title is editable while its projection is
neither editable nor overwritten by a save."""

import pytest
from django.urls import reverse

from runs.models import Job, Run
from tests.runs.admin_helpers import change_url, changelist, one_of_each

# --- append-only records and the protected state ------------------------------------


def _snapshot(obj) -> dict:
    return type(obj).objects.filter(pk=obj.pk).values().get()


@pytest.mark.django_db
@pytest.mark.parametrize("model_name", ["trace", "auditlog", "event", "step"])
def test_records_cannot_be_added_changed_or_deleted(admin_client, run, model_name):
    obj = one_of_each(run)[model_name]
    before = _snapshot(obj)

    assert admin_client.get(reverse(f"admin:runs_{model_name}_add")).status_code == 403
    assert admin_client.get(reverse(f"admin:runs_{model_name}_delete", args=[obj.pk])).status_code == 403
    assert admin_client.post(reverse(f"admin:runs_{model_name}_delete", args=[obj.pk]),
                             {"post": "yes"}).status_code == 403

    listing = admin_client.get(changelist(model_name))
    assert b"delete_selected" not in listing.content
    admin_client.post(changelist(model_name), {"action": "delete_selected", "_selected_action": [obj.pk],
                                               "post": "yes"})
    assert type(obj).objects.filter(pk=obj.pk).exists()

    edited = {key: value for key, value in before.items() if value is not None}
    edited.update({"message": "rewritten", "event": "rewritten", "kind": "run", "to_state": "SUCCEEDED",
                   "status": "success"})
    assert admin_client.post(change_url(obj), edited).status_code == 403
    assert _snapshot(obj) == before


@pytest.mark.django_db
def test_run_state_is_not_an_input_and_a_post_changes_nothing(admin_client, run):
    before = _snapshot(run)

    page = admin_client.get(change_url(run))
    assert page.status_code == 200
    assert b'name="state"' not in page.content
    assert b"EXECUTING" in page.content

    response = admin_client.post(change_url(run), {"state": "SUCCEEDED", "title": "renamed",
                                                   "closing_cause": "succeeded", "cancel_requested_at": ""})
    assert response.status_code == 403
    assert _snapshot(run) == before
    assert admin_client.get(reverse("admin:runs_run_add")).status_code == 403
    assert admin_client.post(reverse("admin:runs_run_delete", args=[run.pk]), {"post": "yes"}).status_code == 403
    assert Run.objects.filter(pk=run.pk, state="EXECUTING").exists()


def _change_form_data(response) -> dict:
    """What the browser would post back for an admin change page, unmodified."""
    data = {}
    form = response.context["adminform"].form
    for name in form.fields:
        value = form[name].value()
        data[name] = "" if value is None else value
    for inline in response.context["inline_admin_formsets"]:
        formset = inline.formset
        for name in formset.management_form.fields:
            data[formset.management_form.add_prefix(name)] = formset.management_form[name].value()
        for inline_form in formset.forms:
            for name in inline_form.fields:
                value = inline_form[name].value()
                data[inline_form.add_prefix(name)] = "" if value is None else value
    return data


@pytest.mark.django_db
def test_job_title_is_editable_but_the_projection_is_not(admin_client, run):
    Job.objects.filter(pk=run.job_id).update(status="running", run_state_snapshot={"state": "EXECUTING"})
    job = Job.objects.get(pk=run.job_id)
    page = admin_client.get(change_url(job))
    assert b'name="status"' not in page.content
    assert b'name="run_state_snapshot"' not in page.content

    data = _change_form_data(page)
    data.update({"title": "renamed", "status": "done", "run_state_snapshot": '{"state": "SUCCEEDED"}',
                 "latest_run": "", "tenant": ""})
    response = admin_client.post(change_url(job), data)

    assert response.status_code == 302, response.content[-3000:]
    job.refresh_from_db()
    assert job.title == "renamed"
    assert job.status == "running"
    assert job.run_state_snapshot == {"state": "EXECUTING"}
    assert job.latest_run_id == run.pk
    assert admin_client.get(reverse("admin:runs_job_add")).status_code == 403


@pytest.mark.django_db
def test_saving_a_job_title_keeps_a_projection_written_meanwhile(admin_client, run, monkeypatch):
    from runs.admin import JobAdmin

    Job.objects.filter(pk=run.job_id).update(status="running")
    job = Job.objects.get(pk=run.job_id)
    data = _change_form_data(admin_client.get(change_url(job)))
    data["title"] = "renamed"
    load = JobAdmin.get_object

    def load_then_projector_moves_on(self, request, object_id, from_field=None):
        loaded = load(self, request, object_id, from_field)
        Job.objects.filter(pk=object_id).update(status="done", run_state_snapshot={"state": "SUCCEEDED"})
        return loaded

    monkeypatch.setattr(JobAdmin, "get_object", load_then_projector_moves_on)
    assert admin_client.post(change_url(job), data).status_code == 302

    job.refresh_from_db()
    assert (job.title, job.status, job.run_state_snapshot) == ("renamed", "done", {"state": "SUCCEEDED"})
