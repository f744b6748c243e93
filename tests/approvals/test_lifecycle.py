"""An approval request's lifecycle is data (``approvals.lifecycle``): every
move is pending → one final status, each taken by a named writer, and a
status written any other way (a save, a queryset update) is refused."""

import pytest
from django.utils import timezone

from approvals.interface import close_pending
from approvals.lifecycle import FINAL, TRANSITIONS, ApprovalStatus, InvalidApprovalTransition, request_finish
from approvals.models import ApprovalRequest
from tests.conftest import open_approval


def test_every_move_leaves_pending_for_a_final_status_once():
    assert {source for source, _ in TRANSITIONS} == {ApprovalStatus.PENDING}
    assert FINAL == set(ApprovalStatus.values) - {ApprovalStatus.PENDING}
    assert all(who for who in TRANSITIONS.values())


@pytest.mark.django_db
@pytest.mark.parametrize("status", sorted(FINAL))
def test_a_pending_request_finishes_once(make_run, status):
    request = open_approval(make_run("AWAITING_HITL", previous_state="POLICY_CHECK"))
    now = timezone.now()

    request_finish(request, status, now=now)

    stored = ApprovalRequest.objects.get(pk=request.pk)
    assert (stored.status, stored.decided_at) == (status, now)
    for again in FINAL:
        with pytest.raises(InvalidApprovalTransition):
            request_finish(stored, again, now=now)
    assert ApprovalRequest.objects.get(pk=request.pk).status == status


@pytest.mark.django_db
def test_a_status_written_outside_the_lifecycle_is_refused(make_run):
    request = open_approval(make_run("AWAITING_HITL", previous_state="POLICY_CHECK"))

    request.status = ApprovalStatus.APPROVED
    with pytest.raises(InvalidApprovalTransition):
        request.save()
    with pytest.raises(InvalidApprovalTransition):
        ApprovalRequest.objects.filter(pk=request.pk).update(status=ApprovalStatus.APPROVED)
    with pytest.raises(InvalidApprovalTransition):
        ApprovalRequest.objects.create(run=request.run, tenant_id=request.tenant_id, status="approved", risk="high",
                                       policy_version=1, action_digest="0" * 64, expires_at=timezone.now())

    assert ApprovalRequest.objects.get(pk=request.pk).status == ApprovalStatus.PENDING
    ApprovalRequest.objects.filter(pk=request.pk).update(risk="high")  # other fields are the caller's


@pytest.mark.django_db
def test_the_kernel_ends_a_pending_request_through_the_interface(make_run):
    run = make_run("AWAITING_HITL", previous_state="POLICY_CHECK")
    request = open_approval(run)

    [closed] = close_pending(run.pk, ApprovalStatus.CANCELLED, reason="the run was cancelled", now=timezone.now())

    assert closed.pk == request.pk
    assert ApprovalRequest.objects.get(pk=request.pk).status == ApprovalStatus.CANCELLED
    assert close_pending(run.pk, ApprovalStatus.CANCELLED, reason="again", now=timezone.now()) == []
