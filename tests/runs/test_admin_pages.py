"""The Django admin's pages of the runs and policy apps: every model is registered,
every changelist and change page opens for a superuser, a run's page shows
its steps, traces and audit rows read-only, an audit row naming a missing
run still renders, and no changelist makes more queries for more rows."""

import pytest
from django.contrib import admin
from django.db import connection
from django.test.utils import CaptureQueriesContext

from runs.models import AuditLog, Run, Step, Trace
from tests.conftest import make_user
from tests.runs.admin_helpers import add_run, change_url, changelist, one_of_each, result_pks

RUNS_MODELS = {"tenant", "membership", "job", "run", "step", "trace", "auditlog", "event", "memoryentry",
               "webhookdelivery", "apitoken"}
POLICY_MODELS = {"policyrule", "policyversion"}


# --- every page opens ----------------------------------------------------------


@pytest.mark.django_db
def test_every_runs_and_policy_model_is_registered():
    for app_label, models in (("runs", RUNS_MODELS), ("policy", POLICY_MODELS)):
        registered = {model._meta.model_name for model in admin.site._registry if model._meta.app_label == app_label}
        assert registered == models


@pytest.mark.django_db
@pytest.mark.parametrize("model_name", sorted(RUNS_MODELS | POLICY_MODELS))
def test_superuser_opens_changelist_and_change_page(admin_client, run, model_name):
    obj = one_of_each(run)[model_name]

    listing = admin_client.get(changelist(model_name))
    assert obj.pk in result_pks(listing)

    detail = admin_client.get(change_url(obj))
    assert detail.status_code == 200
    assert detail.context["original"] == obj


@pytest.mark.django_db
def test_run_page_shows_its_steps_traces_and_audit_rows_read_only(admin_client, run):
    response = admin_client.get(change_url(run))

    assert response.status_code == 200
    inlines = {formset.opts.model: formset for formset in response.context["inline_admin_formsets"]}
    assert set(inlines) == {Step, Trace, AuditLog}
    assert [form.instance.pk for form in inlines[Step].formset.forms] == [run.steps.get().pk]
    assert [form.instance.pk for form in inlines[Trace].formset.forms] == [run.traces.get().pk]
    for formset in inlines.values():
        assert not formset.has_add_permission
        assert not formset.has_change_permission
        assert not formset.has_delete_permission
    assert f"step-{run.pk}".encode() in response.content
    assert b"PREPARING" in response.content


@pytest.mark.django_db
def test_audit_row_naming_a_missing_run_still_renders(admin_client, tenant):
    # Audit rows carry no foreign-key constraint: an invalid_transition row
    # can outlive the rolled-back insert of the run it names.
    orphan = AuditLog.objects.create(run_id=987654, tenant=tenant, event="invalid_transition",
                                     from_state="CREATED", to_state="SUCCEEDED")

    assert result_pks(admin_client.get(changelist("auditlog"))) == [orphan.pk]
    detail = admin_client.get(change_url(orphan))
    assert detail.status_code == 200
    assert b"invalid_transition" in detail.content


# --- no N+1 on the changelists ----------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("model_name", sorted(RUNS_MODELS | POLICY_MODELS))
def test_changelist_query_count_does_not_grow_with_rows(admin_client, tenant, model_name):
    def populate(first: int, count: int) -> None:
        for index in range(first, first + count):
            user = make_user(f"user{index}", tenant)
            add_run(tenant, user, "EXECUTING", title=f"run {index}")

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            response = admin_client.get(changelist(model_name))
        assert response.status_code == 200
        return len(captured)

    populate(0, 1)
    with_one = queries()
    populate(1, 4)
    with_five = queries()

    assert with_five == with_one


@pytest.mark.django_db
def test_the_run_changelist_costs_the_same_queries_for_2_and_20_runs(admin_client, tenant):
    def populate(count: int) -> None:
        previous = Run.objects.first()
        for index in range(count):
            user = make_user(f"user{Run.objects.count()}", tenant)
            previous = add_run(tenant, user, "CLOSED_FAILED", title=f"run {index}", retry_of=previous)

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            response = admin_client.get(changelist("run"))
        assert response.status_code == 200
        return len(captured)

    populate(2)
    with_two = queries()
    populate(18)
    with_twenty = queries()

    assert Run.objects.count() == 20
    assert with_twenty == with_two
