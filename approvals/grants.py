"""Standing grants (docs/approvals.md#standing-grants): "Approve, and allow
this same action for this agent for N hours".

A grant is given with an approval (``approval_decide(grant_hours=N)``), one
per high-risk step of the request, each bound to that step's ``grant_digest``
(the exact action, its sandbox and rated plan, its limits) and to the run's
agent. Only where one person's approval is enough: a request that needs
more than one approver, or an approve with edits, gives none; N is capped by
the tenant (``Tenant.standing_grant_max_hours``, 8 by default, 0: none).

At POLICY_CHECK (``approvals.interface.covering_grants``) a run rated high whose every high-risk step matches a live
grant of its agent, and that needs one approver only, goes on to EXECUTING
without waiting; the grants it used are cited in its policy decision trace
and in a ``grant_applied`` audit row. A step that matches no grant — a
one-character variant, another sandbox, another agent — waits as before.
A grant ends when it expires or is revoked; a revocation takes effect for
every run rated after it.
"""

from datetime import timedelta

from django.utils import timezone

from approvals.models import APPROVERS_GROUP, ApprovalRequest, StandingGrant, grant_digest, normalised_action
from runs.audit import audit
from runs.errors import ConflictError, DeniedError, ErrorCode
from runs.models import AuditEvent, Run, Step
from runs.selectors import tenant_of


def grant_refusal(request: ApprovalRequest, hours, *, approve: bool, edits) -> str | None:
    """Why ``hours`` of standing grant may not come with this decision, or None."""
    cap = request.tenant.standing_grant_max_hours
    if not approve:
        return "a standing grant comes with an approval only"
    if edits:
        return "a standing grant comes with a plain approval, not with edits"
    if request.approvals_required > 1:
        return "this request needs more than one approver: its actions cannot be allowed again without asking"
    if cap == 0:
        return "standing grants are off in this tenant"
    if isinstance(hours, bool) or not isinstance(hours, int) or not 1 <= hours <= cap:
        return f"a standing grant lasts 1 to {cap} hours in this tenant"
    return None


def grants_create(request: ApprovalRequest, actor, hours: int, *, now) -> list[StandingGrant]:
    """In the caller's transaction: a grant for each high-risk step of
    ``request`` (now approved), as its steps are stored."""
    run = Run.objects.only("submitted_by_id").get(pk=request.run_id)
    high = {row["action"]["id"] for row in request.steps if row.get("risk") == "high"}
    grants, seen = [], set()
    for step in Step.objects.filter(run_id=request.run_id, step_id__in=high).order_by("position"):
        digest = grant_digest(step)
        if digest in seen:
            continue
        seen.add(digest)
        grants.append(StandingGrant.objects.create(
            tenant_id=request.tenant_id, agent_id=run.submitted_by_id, digest=digest, action=normalised_action(step),
            request=request, granted_by=actor, expires_at=now + timedelta(hours=hours)))
    audit(AuditEvent.GRANT_CREATED, run_id=request.run_id, tenant_id=request.tenant_id, actor=actor,
          caller="hitl controller", data={"request": request.pk, "hours": hours,
                                          "grants": [grant.pk for grant in grants],
                                          "steps": [grant.action["id"] for grant in grants]})
    return grants


def grants_for_user(user):
    """The grants of the user's tenant, newest first (approvers only)."""
    tenant = tenant_of(user)
    if tenant is None or not user.groups.filter(name=APPROVERS_GROUP).exists():
        return StandingGrant.objects.none()
    return StandingGrant.objects.filter(tenant=tenant).select_related("agent", "granted_by", "revoked_by")


def grant_revoke(grant: StandingGrant, actor) -> StandingGrant:
    """End ``grant`` now: an approver of its tenant may. A grant already
    ended is refused (409); nothing is written then."""
    if not grants_for_user(actor).filter(pk=grant.pk).exists():
        raise DeniedError(ErrorCode.DENIED, "only an approver of its tenant revokes a standing grant",
                          source="approval")
    now = timezone.now()
    if not StandingGrant.objects.live(now).filter(pk=grant.pk).update(revoked_at=now, revoked_by=actor):
        raise ConflictError(ErrorCode.INVALID_INPUT, "this grant has ended already", source="approval",
                            details={"grant": grant.pk})
    audit(AuditEvent.GRANT_REVOKED, run_id=None, tenant_id=grant.tenant_id, actor=actor, caller="hitl controller",
          data={"grant": grant.pk, "request": grant.request_id, "agent": grant.agent.get_username()})
    grant.refresh_from_db()
    return grant
