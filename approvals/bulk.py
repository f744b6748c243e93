"""Bulk decisions (docs/approvals.md#bulk-decisions): one verdict and one
comment over several requests, each named with the action digest of the
row its approver saw.

Each request is decided on its own through ``approval_decide`` — its own
transaction, its own checks (who may decide, still pending, the view not
stale) and its own audit rows — so one that is refused is reported with
its reason and left as it is, and the others are decided all the same.
Nothing is decided when the batch itself is malformed (empty, too long, a
reject with no reason).
"""

from dataclasses import dataclass

from approvals.selectors import request_for_user
from approvals.services import REASON_NEEDED, approval_decide
from runs.errors import ErrorCode, ExecGoError, error_envelope

MAX_BULK = 100


@dataclass(frozen=True)
class BulkOutcome:
    """What became of one request of the batch."""

    request_id: int
    decided: bool
    status: str | None = None  # the request's status after the decision
    approvals: int | None = None  # approvals so far, when decided
    approvals_required: int | None = None
    error: dict | None = None  # the envelope of the refusal, when not decided
    http_status: int | None = None  # the status the single decision would have answered


def approval_decide_many(*, actor, approve: bool, comment: str, picks: list[tuple[int, str]]) -> list[BulkOutcome]:
    """Decide each (request id, digest) of ``picks`` in order; the outcome
    of each. A request named twice is decided once, on the first digest."""
    comment = comment.strip()
    if not picks:
        raise ExecGoError(ErrorCode.INVALID_INPUT, "select at least one request", source="approval",
                          details={"fields": {"requests": ["select at least one request"]}})
    if len(picks) > MAX_BULK:
        message = f"at most {MAX_BULK} requests at a time"
        raise ExecGoError(ErrorCode.INVALID_INPUT, message, source="approval",
                          details={"fields": {"requests": [message]}})
    if not approve and not comment:
        raise ExecGoError(ErrorCode.INVALID_INPUT, REASON_NEEDED, source="approval",
                          details={"fields": {"comment": [REASON_NEEDED]}})
    outcomes: list[BulkOutcome] = []
    seen: set[int] = set()
    for request_id, digest in picks:
        if request_id in seen:
            continue
        seen.add(request_id)
        outcomes.append(_decide_one(actor, approve, comment, request_id, digest))
    return outcomes


def _decide_one(actor, approve: bool, comment: str, request_id: int, digest: str) -> BulkOutcome:
    approval = request_for_user(actor, request_id)  # another tenant's request is not found, as everywhere
    if approval is None:
        return BulkOutcome(request_id, decided=False, http_status=404, error=error_envelope(
            ErrorCode.NOT_FOUND, f"no approval request {request_id}", source="approval"))
    try:
        outcome = approval_decide(request=approval, actor=actor, approve=approve, digest=digest, comment=comment)
    except ExecGoError as exc:
        return BulkOutcome(request_id, decided=False, status=_status_now(actor, request_id), error=exc.envelope,
                           http_status=exc.http_status)
    return BulkOutcome(request_id, decided=True, status=outcome.request.status, approvals=outcome.approvals,
                       approvals_required=outcome.request.approvals_required)


def _status_now(actor, request_id: int) -> str | None:
    approval = request_for_user(actor, request_id)
    return approval.status if approval is not None else None
