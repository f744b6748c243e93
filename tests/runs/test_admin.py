"""The Django admin: every page opens, search and filters narrow the rows,
the append-only records and Run.state cannot be written, "Cancel selected
runs" goes through the cancel service, and the pages show states as badges,
JSON pretty-printed and links between a run and its job, retries and records."""

import html
import json
import re
from datetime import timedelta

import pytest
from django.contrib import admin
from django.contrib.auth.models import Permission, User
from django.contrib.staticfiles import finders
from django.db import connection, models
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from runs.audit import audit
from runs.models import (
    AuditLog,
    Event,
    EventType,
    Job,
    JobStatus,
    Membership,
    MemoryEntry,
    PolicyRule,
    PolicyVersion,
    Run,
    Step,
    StepStatus,
    Tenant,
    Trace,
    TraceKind,
    WebhookDelivery,
)
from runs.statemachine import RunState
from runs.tokens import token_create
from runtime.models import HostCapacity
from tests.conftest import make_user

RUNS_MODELS = {"tenant", "membership", "job", "run", "step", "trace", "auditlog", "event", "memoryentry",
               "policyrule", "policyversion", "webhookdelivery", "apitoken"}


def changelist(model_name: str) -> str:
    return reverse(f"admin:runs_{model_name}_changelist")


def change_url(obj) -> str:
    return reverse(f"admin:runs_{obj._meta.model_name}_change", args=[obj.pk])


def result_pks(response) -> list[int]:
    assert response.status_code == 200, response.content[-2000:]
    return sorted(obj.pk for obj in response.context["cl"].result_list)


def message_texts(response) -> list[str]:
    return [str(message) for message in response.context["messages"]]


def add_run(tenant: Tenant, user: User, state: str = "CREATED", *, title: str = "", **fields) -> Run:
    """A run with one step, one trace, one audit row and one event, placed
    directly in ``state`` (test data, not a transition)."""
    job = Job.objects.create(tenant=tenant, created_by=user, title=title)
    run = Run.objects.create(
        job=job, tenant=tenant, submitted_by=user, title=title, state=state, plan={"steps": []}, timeout_s=600,
        approval_timeout_s=3600, last_state_change_at=timezone.now(), **fields,
    )
    Job.objects.filter(pk=job.pk).update(latest_run=run)
    step = Step.objects.create(run=run, step_id=f"step-{run.pk}", position=0, tool="shell",
                               params={"argv": ["true"]}, timeout_s=5)
    Trace.objects.create(run=run, kind=TraceKind.TRANSITION, from_state="CREATED", to_state="PREPARING",
                         step=step)
    AuditLog.objects.create(run=run, tenant=tenant, event="run_created", actor=user, caller="api",
                            to_state="CREATED")
    Event.objects.create(type=EventType.TASK_SUBMITTED, run=run, task_id=step.step_id, timestamp=timezone.now(),
                         message="shell step submitted")
    return run


@pytest.fixture
def run(tenant, agent):
    return add_run(tenant, agent, "EXECUTING", title="nightly backup")


def one_of_each(run: Run) -> dict:
    return {
        "tenant": run.tenant,
        "membership": Membership.objects.get(user=run.submitted_by),
        "job": run.job,
        "run": run,
        "step": run.steps.get(),
        "trace": run.traces.get(),
        "auditlog": run.audit_entries.get(),
        "event": run.events.get(),
        "memoryentry": MemoryEntry.objects.create(tenant=run.tenant, agent=run.submitted_by, run=run,
                                                  summary="nightly backup: 1 step(s) succeeded"),
        "policyrule": PolicyRule.objects.create(name="no-sudo", tool="shell", field="command", pattern=r"\bsudo\b",
                                                outcome="deny", reason="privilege escalation"),
        "policyversion": PolicyVersion.objects.get_or_create(pk=1)[0],
        "webhookdelivery": WebhookDelivery.objects.create(event="approval.requested", url="https://hooks.example/x",
                                                          payload={"request": 1}, run=run, tenant_id=run.tenant_id),
        "apitoken": token_create(user=run.submitted_by, name="ci")[0],
    }


# --- every page opens ----------------------------------------------------------


@pytest.mark.django_db
def test_every_runs_model_is_registered():
    registered = {model._meta.model_name for model in admin.site._registry if model._meta.app_label == "runs"}
    assert registered == RUNS_MODELS


@pytest.mark.django_db
@pytest.mark.parametrize("model_name", sorted(RUNS_MODELS))
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
@pytest.mark.parametrize("model_name", sorted(RUNS_MODELS))
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


# --- the cancel action ----------------------------------------------------------------


def _cancel(client, *runs):
    return client.post(changelist("run"), {"action": "cancel_runs", "_selected_action": [r.pk for r in runs]},
                       follow=True)


@pytest.fixture
def eager_tasks(settings):
    # run_cancel hands an EXECUTING run to the settle task; run it inline so
    # nothing is left on the broker for a later worker.
    settings.CELERY_TASK_ALWAYS_EAGER = True
    settings.CELERY_TASK_EAGER_PROPAGATES = True


@pytest.mark.django_db(transaction=True)
def test_cancel_action_records_a_cancel_request(admin_client, admin_user, tenant, agent, eager_tasks):
    executing = add_run(tenant, agent, "EXECUTING", executing_started_at=timezone.now())
    executing.steps.update(status="running", run_status="running", attempt=1)

    response = _cancel(admin_client, executing)

    assert response.status_code == 200
    executing.refresh_from_db()
    assert executing.cancel_requested_at is not None
    assert executing.cancel_requested_by == admin_user
    assert executing.state == "EXECUTING"  # its running step sees the request and stops
    request_row = AuditLog.objects.get(run=executing, event="cancel_requested")
    assert (request_row.actor_id, request_row.from_state) == (admin_user.pk, "EXECUTING")
    assert message_texts(response) == [f"Cancel requested for 1 run(s): {executing.pk} (EXECUTING)"]


@pytest.mark.django_db(transaction=True)
def test_cancel_action_applies_to_waiting_runs_and_reports_refusals(admin_client, admin_user, tenant, agent,
                                                                   eager_tasks):
    waiting = add_run(tenant, agent, "AWAITING_HITL", previous_state="POLICY_CHECK")
    done = add_run(tenant, agent, "SUCCEEDED", previous_state="TRACING", closing_cause="succeeded")

    response = _cancel(admin_client, waiting, done)

    waiting.refresh_from_db()
    assert waiting.state == "CLOSED_CANCELLED"
    assert waiting.closing_cause == "cancelled"
    assert AuditLog.objects.get(run=waiting, event="run_cancelled").actor_id == admin_user.pk
    assert AuditLog.objects.filter(run=waiting, event="cancel_requested", actor=admin_user).count() == 1
    assert list(waiting.traces.filter(kind=TraceKind.TRANSITION).values_list("from_state", "to_state")) == [
        ("CREATED", "PREPARING"),  # add_run's own row
        ("AWAITING_HITL", "CANCELLED"), ("CANCELLED", "TRACING"), ("TRACING", "CLOSED_CANCELLED"),
    ]

    done.refresh_from_db()
    assert (done.state, done.cancel_requested_at) == ("SUCCEEDED", None)
    assert AuditLog.objects.filter(run=done, event="cancel_refused", actor=admin_user).count() == 1
    assert message_texts(response) == [
        f"Cancel requested for 1 run(s): {waiting.pk} (CLOSED_CANCELLED)",
        f"Not cancelled — run {done.pk}: run {done.pk} is already SUCCEEDED; nothing to cancel",
    ]


@pytest.mark.django_db(transaction=True)
def test_cancel_action_needs_the_change_permission(client, tenant, agent, eager_tasks):
    viewer = make_user("viewer", tenant)  # staff of the run's tenant (runs.admin_scope)
    User.objects.filter(pk=viewer.pk).update(is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_run"))
    client.force_login(viewer)
    executing = add_run(tenant, agent, "EXECUTING")

    listing = client.get(changelist("run"))
    assert result_pks(listing) == [executing.pk]
    assert b"cancel_runs" not in listing.content

    _cancel(client, executing)
    executing.refresh_from_db()
    assert executing.cancel_requested_at is None
    assert not AuditLog.objects.filter(event="cancel_requested").exists()


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


# --- badges, pretty JSON and links ----------------------------------------------------

# Spelled out here rather than read from runs.admin, so a regrouping there fails.
BADGE_GROUP = {
    "CREATED": "main", "PREPARING": "main", "PLANNING": "main", "POLICY_CHECK": "main", "EXECUTING": "main",
    "AWAITING_HITL": "waiting",
    "REJECTED": "transient", "FAILED": "transient", "TIMEOUT": "transient", "CANCELLED": "transient",
    "TRACING": "transient",
    "SUCCEEDED": "succeeded", "CLOSED_REJECTED": "closed-rejected", "CLOSED_FAILED": "closed-failed",
    "CLOSED_CANCELLED": "closed-cancelled",
}


def changelist_row(response, obj) -> str:
    """The changelist's table row of ``obj``: the one whose first column
    links to it (other rows may link to it too, from a later column)."""
    page = response.content.decode()
    rows = [row for row in page.split("<tr") if re.search(rf'<th class="field-\w+"><a href="{change_url(obj)}">', row)]
    assert len(rows) == 1, f"no single row for {obj!r}"
    return rows[0]


def json_blocks(response) -> list[str]:
    """The text of every pretty-printed JSON block on the page, unescaped."""
    page = response.content.decode()
    return [html.unescape(block) for block in re.findall(r'<pre class="execgo-json">(.*?)</pre>', page, re.S)]


@pytest.mark.django_db
def test_the_run_changelist_shows_each_state_as_its_groups_badge(admin_client, make_run):
    assert set(BADGE_GROUP) == set(RunState)
    runs = {state: make_run(state) for state in BADGE_GROUP}

    response = admin_client.get(changelist("run"))

    for state, group in BADGE_GROUP.items():
        row = changelist_row(response, runs[state])
        assert f'<td class="field-run_state"><span class="badge badge-{group}">{state}</span></td>' in row
    assert b'href="/static/execgo/admin.css"' in response.content


@pytest.mark.django_db
def test_the_state_column_still_sorts(admin_client, make_run):
    for state in ("TRACING", "CREATED", "SUCCEEDED", "AWAITING_HITL"):
        make_run(state)
    from runs.admin import run_state

    column = admin.site._registry[Run].list_display.index(run_state) + 1
    response = admin_client.get(changelist("run"), {"o": str(column)})

    assert [run.state for run in response.context["cl"].result_list] == list(
        Run.objects.order_by("state").values_list("state", flat=True)
    )


@pytest.mark.django_db
def test_job_and_step_lists_show_their_status_as_a_badge(admin_client, run):
    Job.objects.filter(pk=run.job_id).update(status="running")
    run.steps.update(status="skipped")

    job_row = changelist_row(admin_client.get(changelist("job")), run.job)
    assert '<span class="badge badge-job-running">running</span>' in job_row
    step_row = changelist_row(admin_client.get(changelist("step")), run.steps.get())
    assert '<span class="badge badge-step-skipped">skipped</span>' in step_row


def test_the_stylesheet_styles_every_badge_and_caps_the_json_box():
    path = finders.find("execgo/admin.css")
    assert path, "static/execgo/admin.css is not found by the staticfiles finders"
    css = open(path, encoding="utf-8").read()
    groups = {*BADGE_GROUP.values(), *(f"job-{status}" for status in JobStatus),
              *(f"step-{status}" for status in StepStatus)}
    for group in groups:
        assert re.search(rf"\.badge-{group}\b[^{{]*{{[^}}]*background:[^}}]*color:", css), group
    json_box = re.search(r"pre\.execgo-json\s*{([^}]*)}", css).group(1)
    assert "max-height" in json_box and "overflow: auto" in json_box


@pytest.mark.django_db
def test_the_run_page_shows_its_plan_as_indented_json(admin_client, make_run):
    run = make_run("EXECUTING")

    response = admin_client.get(change_url(run))

    assert response.status_code == 200
    assert b'name="plan"' not in response.content
    assert '{\n  "steps": [\n    {\n      "id": "a",\n      "params": {\n        "argv": [\n          "true"\n' \
        '        ]\n      },\n      "tool": "shell"\n    }\n  ]\n}' in json_blocks(response)
    # Escaped, indentation kept: the line itself as the page holds it.
    assert b'<pre class="execgo-json">{\n  &quot;steps&quot;: [\n' in response.content


@pytest.mark.django_db
def test_json_is_escaped(admin_client, make_run):
    run = make_run("EXECUTING", context={"note": "</pre><script>alert(1)</script>", "name": "ünïcode"})

    response = admin_client.get(change_url(run))

    assert b"<script>alert(1)" not in response.content
    assert {"note": "</pre><script>alert(1)</script>", "name": "ünïcode"} in map(json.loads, json_blocks(response))
    assert "ünïcode".encode() in response.content  # ensure_ascii=False: no \\u escapes


def _json_field_names(model) -> list[str]:
    return [field.name for field in model._meta.fields if isinstance(field, models.JSONField)]


def _assert_every_json_field_is_pretty(admin_client, obj, url: str) -> None:
    names = _json_field_names(type(obj))
    assert names
    # A distinct value per field, so a block on the page names the field it shows.
    values = {name: {"field": name, "nested": {"items": [1, 2]}} for name in names}
    if isinstance(obj, AuditLog):  # append-only (UPDATE is refused): a row written with the values
        audit(obj.event, run_id=obj.run_id, tenant_id=obj.tenant_id, data=values["data"])
        obj = AuditLog.objects.latest("id")
        url = change_url(obj)
    else:
        type(obj).objects.filter(pk=obj.pk).update(**values)

    response = admin_client.get(url)

    assert response.status_code == 200
    blocks = json_blocks(response)
    for name, value in values.items():
        assert json.dumps(value, indent=2, sort_keys=True) in blocks, name
        assert f'name="{name}"'.encode() not in response.content, name


@pytest.mark.django_db
@pytest.mark.parametrize("model_name", ["job", "run", "step", "trace", "auditlog", "event", "memoryentry"])
def test_every_json_field_is_pretty_on_its_change_page(admin_client, run, model_name):
    obj = one_of_each(run)[model_name]
    _assert_every_json_field_is_pretty(admin_client, obj, change_url(obj))


@pytest.mark.django_db
def test_host_capabilities_are_pretty_too(admin_client):
    host = HostCapacity.objects.create(host="node-1", task_slots_capacity=4, memory_bytes_capacity=2**30,
                                       pids_capacity=512)
    _assert_every_json_field_is_pretty(admin_client, host,
                                       reverse("admin:runtime_hostcapacity_change", args=[host.pk]))


@pytest.mark.django_db
def test_an_empty_result_shows_as_empty_not_as_none(admin_client, run):
    step = run.steps.get()
    assert step.result is None

    response = admin_client.get(change_url(step))

    assert b"None" not in re.search(rb'field-result">.*?</div>\s*</div>', response.content, re.S).group(0)


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


@pytest.mark.django_db
def test_the_run_list_and_page_link_to_the_job_and_the_retried_run(admin_client, tenant, agent):
    first = add_run(tenant, agent, "CLOSED_FAILED")
    retry = add_run(tenant, agent, "EXECUTING", retry_of=first)
    job_url, first_url = reverse("admin:runs_job_change", args=[retry.job_id]), change_url(first)

    row = changelist_row(admin_client.get(changelist("run")), retry)
    assert f'<td class="field-run_job"><a href="{job_url}">Job {retry.job_id} (pending)</a></td>' in row
    assert f'<td class="field-run_retry_of"><a href="{first_url}">Run {first.pk}</a></td>' in row
    assert '<td class="field-run_retry_of">-</td>' in changelist_row(admin_client.get(changelist("run")), first)

    page = admin_client.get(change_url(retry)).content.decode()
    assert f'<div class="readonly"><a href="{job_url}">' in page
    assert f'<div class="readonly"><a href="{first_url}">' in page


@pytest.mark.django_db
def test_the_job_page_links_each_of_its_runs(admin_client, tenant, agent):
    first = add_run(tenant, agent, "CLOSED_FAILED")
    second = Run.objects.create(job=first.job, tenant=tenant, submitted_by=agent, state="EXECUTING", retry_of=first,
                                timeout_s=600, approval_timeout_s=3600, last_state_change_at=timezone.now())

    response = admin_client.get(change_url(first.job))

    (runs,) = [inline for inline in response.context["inline_admin_formsets"] if inline.opts.model is Run]
    assert [form.instance.pk for form in runs.formset.forms] == [first.pk, second.pk]
    page = response.content.decode()
    for run in (first, second):
        assert f'<a href="{change_url(run)}" class="inlineviewlink">' in page
    assert '<span class="badge badge-main">EXECUTING</span>' in page


@pytest.mark.django_db
@pytest.mark.parametrize("model_name", ["step", "trace", "auditlog", "event", "memoryentry"])
def test_record_rows_link_to_their_run(admin_client, run, model_name):
    obj = one_of_each(run)[model_name]

    row = changelist_row(admin_client.get(changelist(model_name)), obj)

    assert f'<td class="field-record_run"><a href="{change_url(run)}">Run {run.pk} (EXECUTING)</a></td>' in row


@pytest.mark.django_db
def test_an_audit_row_of_a_missing_run_names_it_without_a_link(admin_client, tenant):
    orphan = AuditLog.objects.create(run_id=987654, tenant=tenant, event="invalid_transition")

    row = changelist_row(admin_client.get(changelist("auditlog")), orphan)

    assert '<td class="field-record_run">Run 987654 (not stored)</td>' in row


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
