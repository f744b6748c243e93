"""Search and filters of the Django admin's lists: runs by title, id and
username, the other models by their own fields; runs by state, closing
cause, tenant and created date; records and jobs by tenant, kind, event,
type and status; and the filters each list offers."""

from datetime import timedelta

import pytest
from django.utils import timezone

from runs.models import AuditLog, Event, EventType, Job, Run, TraceKind
from tests.conftest import make_user
from tests.runs.admin_helpers import add_run, changelist, result_pks

# --- search and filters ------------------------------------------------------------


@pytest.mark.django_db
def test_run_search_by_title_id_and_username(admin_client, tenant, other_tenant, agent):
    alpha = add_run(tenant, agent, title="alpha deploy")
    beta = add_run(tenant, agent, title="beta backup")
    outsider = make_user("outsider", other_tenant)
    gamma = add_run(other_tenant, outsider, title="gamma report")

    assert result_pks(admin_client.get(changelist("run"), {"q": "alpha"})) == [alpha.pk]
    assert result_pks(admin_client.get(changelist("run"), {"q": str(beta.pk)})) == [beta.pk]
    assert result_pks(admin_client.get(changelist("run"), {"q": "outsider"})) == [gamma.pk]
    assert result_pks(admin_client.get(changelist("run"), {"q": "no-such-run"})) == []


@pytest.mark.django_db
def test_search_on_the_other_models(admin_client, tenant, agent):
    first = add_run(tenant, agent, title="first job")
    second = add_run(tenant, agent, title="second job")
    AuditLog.objects.create(run=second, tenant=tenant, event="cancel_requested", actor=agent, caller="api")

    assert result_pks(admin_client.get(changelist("job"), {"q": "second"})) == [second.job_id]
    assert result_pks(admin_client.get(changelist("step"), {"q": f"step-{first.pk}"})) == [first.steps.get().pk]
    assert result_pks(admin_client.get(changelist("trace"), {"q": str(second.pk)})) == [second.traces.get().pk]
    assert result_pks(admin_client.get(changelist("event"), {"q": str(first.pk)})) == [first.events.get().pk]
    assert result_pks(admin_client.get(changelist("auditlog"), {"q": "cancel_requested"})) == [
        AuditLog.objects.get(event="cancel_requested").pk
    ]
    assert result_pks(admin_client.get(changelist("auditlog"), {"q": str(first.pk)})) == [
        first.audit_entries.get().pk
    ]
    assert result_pks(admin_client.get(changelist("membership"), {"q": "agent"})) == [agent.membership.pk]
    assert result_pks(admin_client.get(changelist("tenant"), {"q": "acm"})) == [tenant.pk]


@pytest.mark.django_db
def test_run_filters_by_state_tenant_and_created_date(admin_client, tenant, other_tenant, agent):
    executing = add_run(tenant, agent, "EXECUTING")
    succeeded = add_run(tenant, agent, "SUCCEEDED")
    outsider = add_run(other_tenant, make_user("outsider", other_tenant), "EXECUTING")
    old = add_run(tenant, agent, "CLOSED_FAILED")
    Run.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(days=30))

    url = changelist("run")
    assert result_pks(admin_client.get(url, {"state__exact": "EXECUTING"})) == [executing.pk, outsider.pk]
    assert result_pks(admin_client.get(url, {"state__exact": "SUCCEEDED"})) == [succeeded.pk]
    assert result_pks(admin_client.get(url, {"tenant__id__exact": other_tenant.pk})) == [outsider.pk]
    assert result_pks(admin_client.get(url, {"tenant__id__exact": tenant.pk, "state__exact": "EXECUTING"})) == [
        executing.pk
    ]

    cl = admin_client.get(url).context["cl"]
    created_filter = next(spec for spec in cl.filter_specs if getattr(spec, "field_path", "") == "created_at")
    past_week = next(choice for choice in created_filter.choices(cl) if choice["display"] == "Past 7 days")
    recent = admin_client.get(url + past_week["query_string"])
    assert result_pks(recent) == [executing.pk, succeeded.pk, outsider.pk]


@pytest.mark.django_db
def test_record_filters_by_tenant_and_kind(admin_client, tenant, other_tenant, agent):
    ours = add_run(tenant, agent)
    theirs = add_run(other_tenant, make_user("outsider", other_tenant))
    AuditLog.objects.create(run=ours, tenant=tenant, event="zombie_detected", forced_by="zombie_sweeper")

    assert result_pks(admin_client.get(changelist("trace"), {"run__tenant__id__exact": other_tenant.pk})) == [
        theirs.traces.get().pk
    ]
    assert result_pks(admin_client.get(changelist("event"), {"run__tenant__id__exact": tenant.pk})) == [
        ours.events.get().pk
    ]
    assert result_pks(admin_client.get(changelist("auditlog"), {"tenant__id__exact": other_tenant.pk})) == [
        theirs.audit_entries.get().pk
    ]
    assert result_pks(admin_client.get(changelist("auditlog"), {"forced_by": "zombie_sweeper"})) == [
        AuditLog.objects.get(event="zombie_detected").pk
    ]
    assert result_pks(admin_client.get(changelist("trace"), {"kind__exact": TraceKind.POLICY_DECISION})) == []
    assert result_pks(admin_client.get(changelist("job"), {"tenant__id__exact": tenant.pk})) == [ours.job_id]
    assert result_pks(admin_client.get(changelist("step"), {"run__tenant__id__exact": tenant.pk})) == [
        ours.steps.get().pk
    ]


@pytest.mark.django_db
@pytest.mark.parametrize(("model_name", "filters"), [
    ("run", {"state", "closing_cause", "tenant", "planner", "created_at"}),
    ("auditlog", {"event", "tenant", "created_at"}),
    ("trace", {"kind"}),
    ("event", {"type"}),
    ("job", {"status", "tenant"}),
])
def test_each_list_offers_its_filters(admin_client, tenant, other_tenant, agent, model_name, filters):
    add_run(tenant, agent)
    add_run(other_tenant, make_user("outsider", other_tenant))  # a tenant filter hides itself with one tenant
    cl = admin_client.get(changelist(model_name)).context["cl"]
    assert filters <= {spec.field_path for spec in cl.filter_specs}


@pytest.mark.django_db
def test_run_filters_by_closing_cause_and_tenant(admin_client, tenant, other_tenant, agent, make_run):
    failed = make_run("CLOSED_FAILED", previous_state="TRACING", closing_cause="failed")
    timed_out = make_run("CLOSED_FAILED", previous_state="TRACING", closing_cause="run_timeout")
    outsider = add_run(other_tenant, make_user("outsider", other_tenant), "CLOSED_FAILED", closing_cause="failed")
    url = changelist("run")

    assert result_pks(admin_client.get(url)) == [failed.pk, timed_out.pk, outsider.pk]
    assert result_pks(admin_client.get(url, {"closing_cause__exact": "failed"})) == [failed.pk, outsider.pk]
    assert result_pks(admin_client.get(url, {"closing_cause__exact": "run_timeout"})) == [timed_out.pk]
    assert result_pks(admin_client.get(url, {"tenant__id__exact": tenant.pk})) == [failed.pk, timed_out.pk]
    assert result_pks(admin_client.get(url, {"closing_cause__exact": "failed", "tenant__id__exact": tenant.pk})) == [
        failed.pk
    ]


@pytest.mark.django_db
def test_record_and_job_filters_narrow_the_list(admin_client, tenant, agent):
    ours = add_run(tenant, agent)
    other = add_run(tenant, agent)
    Job.objects.filter(pk=other.job_id).update(status="failed")
    AuditLog.objects.create(run=ours, tenant=tenant, event="cancel_requested", actor=agent)
    Event.objects.create(type=EventType.RUN_STATE_CHANGED, run=other, timestamp=timezone.now())

    assert result_pks(admin_client.get(changelist("auditlog"), {"event__exact": "cancel_requested"})) == [
        AuditLog.objects.get(event="cancel_requested").pk
    ]
    assert result_pks(admin_client.get(changelist("event"), {"type__exact": EventType.RUN_STATE_CHANGED})) == [
        other.events.get(type=EventType.RUN_STATE_CHANGED).pk
    ]
    assert result_pks(admin_client.get(changelist("job"), {"status__exact": "failed"})) == [other.job_id]
