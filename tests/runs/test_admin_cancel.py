"""The Django admin's "Cancel selected runs" action goes through the cancel
service: it records a cancel request, applies it at once to a waiting run,
reports the runs it refuses, and needs the change permission."""

import pytest
from django.contrib.auth.models import Permission, User
from django.utils import timezone

from runs.models import AuditLog, TraceKind
from tests.conftest import make_user
from tests.runs.admin_helpers import add_run, changelist, result_pks


def message_texts(response) -> list[str]:
    return [str(message) for message in response.context["messages"]]


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
