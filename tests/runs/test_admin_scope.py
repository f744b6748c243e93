"""The Django admin is tenant-scoped: a staff user of tenant B holding every
permission sees and acts on nothing of tenant A, in every model any app
registers (the walk below reads ``admin.site._registry``, so a model
registered later is covered, or fails here until it is); the superuser
sees both tenants.

Tenant A's rows all carry the marker ``zqalpha``: no page B's staff can open
(lists, filters, forms, popups, autocomplete) may contain it."""

import json
from datetime import timedelta

import pytest
from django.contrib import admin
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Group, Permission, User
from django.forms.models import model_to_dict
from django.urls import reverse
from django.utils import timezone

from approvals.models import ApprovalRequest, Decision, Notification, StandingGrant
from policy.models import PolicyRule
from runs.admin_scope import SuperuserOnlyAdmin, TenantScopedAdmin
from runs.models import (
    ApiToken,
    AuditLog,
    Event,
    EventType,
    Job,
    Membership,
    MemoryEntry,
    Run,
    Step,
    Tenant,
    Trace,
    TraceKind,
    WebhookDelivery,
)
from tests.conftest import make_token, make_user

pytestmark = pytest.mark.django_db

MARKER = "zqalpha"


def populate(name: str) -> Tenant:
    """A tenant with one row of every tenant-owned model, each naming ``name``."""
    tenant = Tenant.objects.create(name=f"{name} corp")
    agent = make_user(f"{name}_agent", tenant, groups=("agents",))
    approver = make_user(f"{name}_approver", tenant, groups=("approvers",))
    make_token(agent, name=f"{name} secret token")
    agent.groups.add(Group.objects.create(name=f"{name}-ops"))
    job = Job.objects.create(tenant=tenant, created_by=agent, title=f"{name} secret job")
    run = Run.objects.create(
        job=job, tenant=tenant, submitted_by=agent, title=f"{name} secret run", state="EXECUTING",
        plan={"steps": [{"id": "a", "tool": "shell", "params": {"argv": ["echo", f"{name} secret"]}}]},
        timeout_s=600, approval_timeout_s=3600, last_state_change_at=timezone.now(),
        executing_started_at=timezone.now(),
    )
    Job.objects.filter(pk=job.pk).update(latest_run=run)
    step = Step.objects.create(run=run, step_id=f"{name}-step", position=0, tool="shell",
                               params={"argv": ["echo", f"{name} secret"]}, timeout_s=5,
                               result={"output": {"stdout": f"{name} secret output"}})
    Trace.objects.create(run=run, kind=TraceKind.TRANSITION, from_state="POLICY_CHECK", to_state="EXECUTING",
                         step=step, data={"note": f"{name} secret"})
    AuditLog.objects.create(run=run, tenant=tenant, event="run_created", actor=agent, caller="api",
                            to_state="CREATED", data={"note": f"{name} secret"})
    Event.objects.create(type=EventType.TASK_SUBMITTED, run=run, task_id=step.step_id, timestamp=timezone.now(),
                         message=f"{name} secret step submitted")
    done = Run.objects.create(
        job=job, tenant=tenant, submitted_by=agent, title=f"{name} done run", state="SUCCEEDED",
        plan={"steps": []}, timeout_s=600, approval_timeout_s=3600, last_state_change_at=timezone.now(),
    )
    MemoryEntry.objects.create(tenant=tenant, agent=agent, run=done, summary=f"{name} secret memory")
    WebhookDelivery.objects.create(event="run.final", url=f"https://{name}.example/hook", run=done, tenant=tenant,
                                   payload={"note": f"{name} secret"})
    waiting = Run.objects.create(
        job=job, tenant=tenant, submitted_by=agent, title=f"{name} waiting run", state="AWAITING_HITL",
        plan={"steps": []}, timeout_s=600, approval_timeout_s=3600, last_state_change_at=timezone.now(),
    )
    request = ApprovalRequest.objects.create(
        run=waiting, tenant=tenant, steps=[{"id": "a", "command": f"{name} secret"}], risk="high",
        policy_version=1, action_digest="0" * 64, expires_at=timezone.now() + timedelta(hours=1),
    )
    Decision.objects.create(request=request, decider=approver, decision="approve", comment=f"{name} secret")
    PolicyRule.objects.create(tenant=tenant, name=f"{name}-rule", tool="shell", field="command",
                              pattern=f"{name} secret", outcome="high", reason=f"{name} secret rule")
    Notification.objects.create(tenant=tenant, request=request, recipient=approver, kind="requested",
                                channel="email", address=f"{name}@example.com", subject=f"{name} secret",
                                body=f"{name} secret")
    StandingGrant.objects.create(tenant=tenant, agent=agent, digest="0" * 64, action={"note": f"{name} secret"},
                                 request=request, granted_by=approver, expires_at=timezone.now() + timedelta(hours=1))
    return tenant


@pytest.fixture
def alpha(db):
    return populate(MARKER)


@pytest.fixture
def bravo(db):
    return populate("bravo")


@pytest.fixture
def bravo_staff(bravo):
    """Staff of tenant B with every permission there is: only the scope stops them."""
    user = make_user("bravo_staff", bravo)
    User.objects.filter(pk=user.pk).update(is_staff=True)
    user.user_permissions.set(Permission.objects.all())
    return User.objects.get(pk=user.pk)


@pytest.fixture
def staff_client(client, bravo_staff):
    client.force_login(bravo_staff)
    return client


@pytest.fixture
def operator(db):
    return User.objects.create_superuser("operator", password="pw-operator")


def admin_url(model, view: str, *args) -> str:
    return reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_{view}", args=args)


def registered():
    return sorted(admin.site._registry.items(), key=lambda item: item[0]._meta.label)


def scoped_models():
    return [(model, model_admin) for model, model_admin in registered() if isinstance(model_admin, TenantScopedAdmin)]


def rows_of(model_admin, tenant: Tenant):
    return model_admin.model._default_manager.filter(**{model_admin.tenant_path: tenant.pk})


def object_url_id(model, obj) -> str:
    return str(obj.pk)


def snapshot(rows) -> list[dict]:
    return [model_to_dict(row) for row in rows.order_by("pk")]


def test_every_registered_model_is_tenant_scoped_or_superuser_only():
    assert registered(), "nothing registered"
    for model, model_admin in registered():
        assert isinstance(model_admin, (TenantScopedAdmin, SuperuserOnlyAdmin)), model._meta.label
        if isinstance(model_admin, TenantScopedAdmin):
            assert model_admin.tenant_path, model._meta.label
    labels = {model._meta.label for model, _ in scoped_models()}
    assert {"runs.Run", "runs.Step", "runs.Trace", "runs.AuditLog", "runs.Event", "runs.MemoryEntry", "runs.Job",
            "approvals.ApprovalRequest", "auth.User", "runs.ApiToken"} <= labels


def test_bravo_staff_see_no_row_of_alpha_in_any_changelist(staff_client, alpha, bravo):
    for model, model_admin in scoped_models():
        theirs, ours = rows_of(model_admin, alpha), rows_of(model_admin, bravo)
        assert theirs.exists() and ours.exists(), f"{model._meta.label}: the fixture must hold rows of both tenants"
        for query in ("", "?_facets=1", "?_popup=1&_to_field=id"):
            response = staff_client.get(admin_url(model, "changelist") + query)
            assert response.status_code == 200, (model._meta.label, query)
            shown = set(response.context["cl"].queryset.values_list("pk", flat=True))
            assert not shown & set(theirs.values_list("pk", flat=True)), (model._meta.label, query)
            assert shown & set(ours.values_list("pk", flat=True)), (model._meta.label, query)
            assert MARKER not in response.content.decode(), (model._meta.label, query)


def test_a_crafted_filter_or_search_finds_nothing_of_alpha(staff_client, alpha, bravo):
    for model, path in [(Run, "tenant__id__exact"), (Job, "tenant__id__exact"), (Step, "run__tenant__id__exact"),
                        (AuditLog, "tenant__id__exact"), (ApprovalRequest, "tenant__id__exact")]:
        response = staff_client.get(admin_url(model, "changelist") + f"?{path}={alpha.pk}")
        assert response.status_code == 200
        assert all(row.pk not in set(model.objects.filter(**{path: alpha.pk}).values_list("pk", flat=True))
                   for row in response.context["cl"].queryset), model._meta.label
        assert MARKER not in response.content.decode()
    response = staff_client.get(admin_url(Run, "changelist") + f"?q={MARKER}")
    assert list(response.context["cl"].queryset) == []
    # A lookup the admin never offered is refused, not run.
    assert staff_client.get(admin_url(Run, "changelist") + "?tenant__name__startswith=z").status_code == 400


def test_relation_filters_list_only_bravos_values(staff_client, operator, client, alpha, bravo):
    def groups_filter(response) -> set[str]:
        spec = next(spec for spec in response.context["cl"].filter_specs if spec.field_path == "groups")
        return {label for _pk, label in spec.lookup_choices}

    assert groups_filter(staff_client.get(admin_url(User, "changelist"))) == {"agents", "approvers", "bravo-ops"}
    # A filter with a single value is not shown at all: B's staff see no tenant filter.
    response = staff_client.get(admin_url(Job, "changelist"))
    assert [spec for spec in response.context["cl"].filter_specs if spec.field_path == "tenant"] == []
    client.force_login(operator)
    assert f"{MARKER}-ops" in groups_filter(client.get(admin_url(User, "changelist")))
    response = client.get(admin_url(Job, "changelist"))
    spec = next(spec for spec in response.context["cl"].filter_specs if spec.field_path == "tenant")
    assert {label for _pk, label in spec.lookup_choices} == {f"{MARKER} corp", "bravo corp"}


def test_every_object_page_of_alpha_is_a_404(staff_client, alpha, bravo):
    for model, model_admin in scoped_models():
        for obj in rows_of(model_admin, alpha):
            object_id = object_url_id(model, obj)
            for view in ("change", "history", "delete"):
                url = admin_url(model, view, object_id)
                assert staff_client.get(url).status_code == 404, url
                assert staff_client.post(url, {"post": "yes"}).status_code == 404, url
        assert snapshot(rows_of(model_admin, alpha)) == snapshot(rows_of(model_admin, alpha))  # still there
    user = User.objects.get(username=f"{MARKER}_agent")
    assert staff_client.get(admin_url(User, "password_change", user.pk)).status_code == 404
    assert staff_client.post(admin_url(User, "password_change", user.pk),
                             {"password1": "Taken-over-1", "password2": "Taken-over-1"}).status_code == 404
    assert User.objects.get(pk=user.pk).check_password(f"pw-{MARKER}_agent")


def test_alpha_rows_are_untouched_by_posts_to_bravos_pages(staff_client, alpha, bravo):
    before = {model: snapshot(rows_of(model_admin, alpha)) for model, model_admin in scoped_models()}
    for model, model_admin in scoped_models():
        ids = [object_url_id(model, obj) for obj in rows_of(model_admin, alpha)]
        for obj_id in ids:
            staff_client.post(admin_url(model, "change", obj_id), {"title": "taken", "name": "taken"})
            staff_client.post(admin_url(model, "delete", obj_id), {"post": "yes"})
    assert {model: snapshot(rows_of(model_admin, alpha)) for model, model_admin in scoped_models()} == before


def test_actions_on_alpha_rows_do_nothing(staff_client, alpha, bravo):
    """Every action the changelist offers B's staff, posted with A's ids."""
    before = {model: snapshot(rows_of(model_admin, alpha)) for model, model_admin in scoped_models()}
    acted = 0
    for model, model_admin in scoped_models():
        listing = staff_client.get(admin_url(model, "changelist"))
        actions = [name for name, _label in (listing.context["action_form"].fields["action"].choices
                                             if listing.context.get("action_form") else []) if name]
        ids = [str(pk) for pk in rows_of(model_admin, alpha).values_list("pk", flat=True)]
        for action in actions:
            staff_client.post(admin_url(model, "changelist"), {"action": action, "_selected_action": ids,
                                                               "post": "yes", "index": 0})
            acted += 1
    assert acted >= 3  # cancel runs, approve / reject requests, delete where allowed
    assert {model: snapshot(rows_of(model_admin, alpha)) for model, model_admin in scoped_models()} == before
    assert not AuditLog.objects.filter(event__in=["cancel_requested", "approval_approved", "approval_rejected"],
                                       tenant=alpha).exists()


def test_autocomplete_and_foreign_key_choices_offer_nothing_of_alpha(staff_client, alpha, bravo):
    url = reverse("admin:autocomplete")
    asked = 0
    for model, _model_admin in registered():
        for field in model._meta.get_fields():
            if not (field.is_relation and field.concrete and field.related_model in admin.site._registry):
                continue
            for term in ("", MARKER):
                response = staff_client.get(url, {"app_label": model._meta.app_label,
                                                  "model_name": model._meta.model_name,
                                                  "field_name": field.name, "term": term})
                asked += 1
                assert response.status_code in (200, 403, 404), (model._meta.label, field.name)
                assert MARKER not in response.content.decode(), (model._meta.label, field.name, term)
    assert asked > 10
    response = staff_client.get(url, {"app_label": "runs", "model_name": "membership", "field_name": "user",
                                      "term": "bravo"})
    assert {result["text"] for result in json.loads(response.content)["results"]} >= {"bravo_agent"}

    add_token = staff_client.get(admin_url(ApiToken, "add"))
    assert add_token.status_code == 200 and MARKER not in add_token.content.decode()
    assert "bravo_approver" in add_token.content.decode()


def test_bravos_own_add_and_change_pages_show_nothing_of_alpha(staff_client, alpha, bravo):
    opened = 0
    for model, model_admin in scoped_models():
        add = staff_client.get(admin_url(model, "add"))
        assert add.status_code in (200, 403), model._meta.label
        assert MARKER not in add.content.decode(), model._meta.label
        for obj in rows_of(model_admin, bravo):
            page = staff_client.get(admin_url(model, "change", object_url_id(model, obj)))
            assert page.status_code == 200, (model._meta.label, obj.pk)
            assert MARKER not in page.content.decode(), (model._meta.label, obj.pk)
            opened += 1
    assert opened >= len(scoped_models())


def test_an_object_cannot_be_given_to_alpha(staff_client, alpha, bravo):
    theirs = User.objects.get(username=f"{MARKER}_approver")  # has no token yet
    response = staff_client.post(admin_url(ApiToken, "add"), {"user": theirs.pk, "name": "planted"})
    assert response.status_code == 200 and response.context["adminform"].form.errors
    assert not ApiToken.objects.filter(user=theirs).exists()

    added = staff_client.post(admin_url(User, "add"), {"username": "bravo_new", "password1": "A-long-pass-1",
                                                       "password2": "A-long-pass-1", "usable_password": "true"})
    assert added.status_code == 302, added.content[-2000:]
    assert Membership.objects.get(user__username="bravo_new").tenant == bravo

    ours = User.objects.get(username="bravo_agent")
    held = set(ours.groups.values_list("pk", flat=True))
    data = {"username": "bravo_agent", "is_active": "on", "is_staff": "on", "is_superuser": "on",
            "groups": sorted(held), "user_permissions": [Permission.objects.get(codename="delete_tenant").pk],
            "date_joined_0": "2026-01-01", "date_joined_1": "00:00:00"}
    saved = staff_client.post(admin_url(User, "change", ours.pk), data)
    assert saved.status_code == 302, saved.context["adminform"].form.errors
    ours.refresh_from_db()
    assert ours.is_staff, "the change was saved"
    assert not ours.is_superuser, "tenant staff made a superuser"
    assert not ours.user_permissions.exists()
    assert set(ours.groups.values_list("pk", flat=True)) == held  # bravo-ops kept, though not a role

    theirs_group = Group.objects.get(name=f"{MARKER}-ops")
    refused = staff_client.post(admin_url(User, "change", ours.pk), {**data, "groups": [theirs_group.pk]})
    assert refused.status_code == 200 and "groups" in refused.context["adminform"].form.errors
    assert set(ours.groups.values_list("pk", flat=True)) == held


def test_history_of_alpha_objects_stays_hidden(staff_client, operator, alpha, bravo):
    run = Run.objects.get(title=f"{MARKER} secret run")
    LogEntry.objects.log_actions(user_id=operator.pk, queryset=[run], action_flag=CHANGE,
                                 change_message=f"{MARKER} operator note", single_object=True)
    assert LogEntry.objects.filter(object_id=str(run.pk)).count() == 1
    assert staff_client.get(admin_url(Run, "history", run.pk)).status_code == 404
    index = staff_client.get(reverse("admin:index"))
    assert MARKER not in index.content.decode()


def test_superuser_only_models_are_closed_to_tenant_staff(staff_client, alpha, bravo):
    closed = [model for model, model_admin in registered() if isinstance(model_admin, SuperuserOnlyAdmin)]
    assert {model._meta.label for model in closed} >= {"auth.Group", "policy.PolicyVersion", "runtime.HostCapacity",
                                                       "django_celery_beat.PeriodicTask", "axes.AccessAttempt"}
    group = Group.objects.get(name="agents")
    for model in closed:
        for url in (admin_url(model, "changelist"), admin_url(model, "add"), admin_url(model, "change", 1),
                    admin_url(model, "history", 1), admin_url(model, "delete", 1)):
            assert staff_client.get(url).status_code in (302, 403), url
        assert staff_client.post(admin_url(model, "add"), {"name": "taken"}).status_code in (302, 403)
    assert staff_client.post(admin_url(Group, "change", group.pk), {"name": "taken"}).status_code == 403
    assert Group.objects.filter(name="agents").exists()
    index = staff_client.get(reverse("admin:index"))
    for model in closed:
        assert admin_url(model, "changelist") not in index.content.decode()


def test_staff_without_a_tenant_see_nothing(client, alpha, bravo):
    loner = User.objects.create_user("loner", password="pw-loner", is_staff=True)
    loner.user_permissions.set(Permission.objects.all())
    client.force_login(loner)
    for model, _model_admin in scoped_models():
        response = client.get(admin_url(model, "changelist"))
        assert response.status_code == 200
        assert list(response.context["cl"].queryset) == [], model._meta.label
    assert client.get(admin_url(Job, "add")).status_code == 403


def test_the_superuser_sees_both_tenants(client, operator, alpha, bravo):
    client.force_login(operator)
    for model, model_admin in scoped_models():
        response = client.get(admin_url(model, "changelist"))
        assert response.status_code == 200
        shown = set(response.context["cl"].queryset.values_list("pk", flat=True))
        for tenant in (alpha, bravo):
            assert set(rows_of(model_admin, tenant).values_list("pk", flat=True)) <= shown, model._meta.label
        obj = rows_of(model_admin, alpha).first()
        assert client.get(admin_url(model, "change", object_url_id(model, obj))).status_code == 200
    for model, model_admin in registered():
        if isinstance(model_admin, SuperuserOnlyAdmin):
            assert client.get(admin_url(model, "changelist")).status_code == 200, model._meta.label
