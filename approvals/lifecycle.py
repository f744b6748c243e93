"""An approval request's lifecycle, declared as data.

A request is opened ``pending`` with its run's move into AWAITING_HITL and
ends in exactly one final status, once. ``TRANSITIONS`` is every move there
is, with who takes it; ``request_finish`` is the only writer of
``ApprovalRequest.status`` (the model refuses a status written any other
way: ``approvals.models``).

    pending ──► approved   (the Nth approval of distinct approvers)
        │ ├───► rejected   (one reject, with its reason)
        │ ├───► expired    (at expires_at, nobody decided: default reject)
        │ ├───► cancelled  (the run was cancelled while waiting)
        │ └───► voided     (the plan or the policy changed under it)
"""

from contextlib import contextmanager
from contextvars import ContextVar

from django.db import models


class ApprovalStatus(models.TextChoices):
    PENDING = "pending"
    APPROVED = "approved"
    REJECTED = "rejected"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    VOIDED = "voided"


A = ApprovalStatus
TRANSITIONS: dict[tuple[str, str], str] = {
    (A.PENDING, A.APPROVED): "the decision service, once the quorum approved",
    (A.PENDING, A.REJECTED): "the decision service, on a reject (which needs a reason)",
    (A.PENDING, A.VOIDED): "the decision service, when the plan or the policy changed under the request",
    (A.PENDING, A.EXPIRED): "the expiry at expires_at, or the sweeper when the expiry's message was lost",
    (A.PENDING, A.CANCELLED): "a cancel of the run while it waits",
}
FINAL = frozenset(target for _, target in TRANSITIONS)


class InvalidApprovalTransition(Exception):
    pass


_writing: ContextVar[bool] = ContextVar("approval_status_writer", default=False)


def writing_status() -> bool:
    """Whether ``request_finish`` is writing a status now (the model's guard)."""
    return _writing.get()


@contextmanager
def _as_the_writer():
    token = _writing.set(True)
    try:
        yield
    finally:
        _writing.reset(token)


def request_finish(request, status: str, *, now, decided_by=None, comment: str = "", reason: str = "") -> None:
    """Move ``request`` (locked by the caller, in its transaction) from
    pending to the final ``status``, and record its ``approval.decided``
    webhook in the same transaction."""
    if (request.status, status) not in TRANSITIONS:
        raise InvalidApprovalTransition(
            f"approval request {request.pk}: {request.status} -> {status} is not a transition")
    request.status, request.decided_at = status, now
    with _as_the_writer():
        request.save(update_fields=["status", "decided_at"])
    request.notify_decided(decided_by=decided_by, comment=comment, reason=reason)
