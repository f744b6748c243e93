"""How the Django admin shows the runs app: states and statuses as badges
(the stylesheet styles each), the state column still sorting, JSON
pretty-printed and escaped, an empty result as empty, and links between a
run and its job, its retries and its records."""

import html
import json
import re

import pytest
from django.contrib import admin
from django.contrib.staticfiles import finders
from django.db import models
from django.urls import reverse
from django.utils import timezone

from runs.audit import audit
from runs.models import AuditLog, Job, JobStatus, Run, StepStatus
from runs.statemachine import RunState
from runtime.models import HostCapacity
from tests.runs.admin_helpers import add_run, change_url, changelist, one_of_each

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
