"""Approvals in the REST API, for people (a session or a personal token):
list, read, approve, reject, and decide several at once. An agent's token
gets 403 on every one of them; decisions go through
``approvals.services.approval_decide``, each naming the ``digest`` of the
request as its approver read it."""

from django.urls import reverse
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.permissions import BasePermission
from rest_framework.response import Response
from rest_framework.views import APIView

from approvals.bulk import MAX_BULK, approval_decide_many
from approvals.grants import grant_revoke, grants_for_user
from approvals.models import AGENTS_GROUP, APPROVERS_GROUP, ApprovalRequest, ApprovalStatus, StandingGrant
from approvals.selectors import request_for_user, requests_for_user
from approvals.services import approval_decide
from runs.api.serializers import StringField


class IsHumanApprover(BasePermission):
    message = "approvals are decided by people in the approvers group, never with an agent's token"

    def has_permission(self, request, view) -> bool:
        groups = set(request.user.groups.values_list("name", flat=True)) if request.user.is_authenticated else set()
        return APPROVERS_GROUP in groups and AGENTS_GROUP not in groups


class DecisionSerializer(serializers.Serializer):
    decider = serializers.CharField(source="decider.username")
    decision = serializers.CharField()
    comment = serializers.CharField()
    decided_at = serializers.DateTimeField()
    digest = serializers.CharField(help_text="the action digest of the plan this decision was made on")


class ApprovalRequestSerializer(serializers.ModelSerializer):
    run_id = serializers.IntegerField()
    approvals = serializers.IntegerField(source="approvals_so_far")
    edited_by = serializers.CharField(source="edited_by.username", allow_null=True, default=None)
    decisions = DecisionSerializer(many=True)
    page_url = serializers.SerializerMethodField()

    class Meta:
        model = ApprovalRequest
        fields = ["id", "run_id", "status", "risk", "policy_version", "action_digest", "approvals_required",
                  "approvals", "requested_at", "expires_at", "decided_at", "steps", "original_steps", "edited_by",
                  "versions", "decisions", "page_url"]

    def get_page_url(self, approval: ApprovalRequest) -> str:
        return reverse("approvals:detail", args=[approval.pk])


class CommentSerializer(serializers.Serializer):
    digest = StringField(max_length=64, help_text="the action_digest of the request as read: a decision names "
                                                  "the plan it was made on (another one is a 409 stale_view)")
    comment = StringField(max_length=2000, required=False, allow_blank=True, default="")


class ApproveSerializer(CommentSerializer):
    edits = serializers.DictField(child=serializers.DictField(), required=False,
                                  help_text="approve with edits: {step id: {argv | script | url: new value}}")
    grant_hours = serializers.IntegerField(
        required=False, min_value=1, max_value=24 * 365,
        help_text="approve, and allow the same high-risk actions of this agent again without asking for this "
                  "many hours (a standing grant; capped by the tenant; one approver's requests only)")


def _request_or_404(request, request_id: int) -> ApprovalRequest:
    approval = request_for_user(request.user, request_id)
    if approval is None:
        raise NotFound(f"no approval request {request_id}")
    return approval


class ApprovalListView(APIView):
    permission_classes = [IsHumanApprover]

    @extend_schema(responses=ApprovalRequestSerializer(many=True), parameters=[
        OpenApiParameter("status", str, enum=[*ApprovalStatus.values, "decided"], required=False)])
    def get(self, request):
        status = request.query_params.get("status")
        if status is not None and status not in (*ApprovalStatus.values, "decided"):  # "" too: not a status
            raise ValidationError({"status": [f"unknown status {status!r}"]})
        approvals = requests_for_user(request.user, status=status).prefetch_related("decisions__decider")[:200]
        return Response(ApprovalRequestSerializer(approvals, many=True).data)


class ApprovalDetailView(APIView):
    permission_classes = [IsHumanApprover]

    @extend_schema(responses=ApprovalRequestSerializer)
    def get(self, request, request_id: int):
        return Response(ApprovalRequestSerializer(_request_or_404(request, request_id)).data)


class ApprovalDecideView(APIView):
    permission_classes = [IsHumanApprover]
    approve = True

    @extend_schema(request=ApproveSerializer, responses=ApprovalRequestSerializer)
    def post(self, request, request_id: int):
        approval = _request_or_404(request, request_id)
        body = (ApproveSerializer if self.approve else CommentSerializer)(data=request.data)
        body.is_valid(raise_exception=True)
        outcome = approval_decide(request=approval, actor=request.user, approve=self.approve,
                                  digest=body.validated_data["digest"], comment=body.validated_data["comment"].strip(),
                                  edits=body.validated_data.get("edits") or None,
                                  grant_hours=body.validated_data.get("grant_hours"))
        return Response(ApprovalRequestSerializer(outcome.request).data)


class ApprovalRejectView(ApprovalDecideView):
    approve = False

    @extend_schema(request=CommentSerializer, responses=ApprovalRequestSerializer,
                   description="A reject needs a reason: a non-empty comment.")
    def post(self, request, request_id: int):
        return super().post(request, request_id)




class BulkPickSerializer(serializers.Serializer):
    id = serializers.IntegerField(min_value=1, max_value=2**63 - 1)
    digest = StringField(max_length=64, help_text="the action_digest of this request as read")


class BulkDecisionSerializer(serializers.Serializer):
    decision = serializers.ChoiceField(choices=["approve", "reject"])
    comment = StringField(max_length=2000, required=False, allow_blank=True, default="",
                          help_text="one comment for every request; a reject needs one")
    requests = BulkPickSerializer(many=True, allow_empty=False, max_length=MAX_BULK)


class BulkResultSerializer(serializers.Serializer):
    id = serializers.IntegerField(source="request_id")
    decided = serializers.BooleanField()
    status = serializers.CharField(allow_null=True, help_text="the request's status after this call")
    approvals = serializers.IntegerField(allow_null=True)
    approvals_required = serializers.IntegerField(allow_null=True)
    error = serializers.DictField(allow_null=True, help_text="why it was not decided: the error envelope")


class BulkResponseSerializer(serializers.Serializer):
    results = BulkResultSerializer(many=True)


class ApprovalBulkView(APIView):
    """Approve or reject several requests with one comment. Each is decided
    on its own, on the digest given for it: one refused (stale, already
    decided, not yours to decide) is reported in ``results`` with its error
    envelope and left as it is; the others are decided. 200 whatever each
    outcome; 400 with nothing decided when the batch is malformed."""

    permission_classes = [IsHumanApprover]

    @extend_schema(request=BulkDecisionSerializer, responses=BulkResponseSerializer)
    def post(self, request):
        body = BulkDecisionSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        outcomes = approval_decide_many(actor=request.user, approve=data["decision"] == "approve",
                                        comment=data["comment"],
                                        picks=[(pick["id"], pick["digest"]) for pick in data["requests"]])
        return Response(BulkResponseSerializer({"results": outcomes}).data)


class StandingGrantSerializer(serializers.ModelSerializer):
    agent = serializers.CharField(source="agent.username")
    granted_by = serializers.CharField(source="granted_by.username")
    revoked_by = serializers.CharField(source="revoked_by.username", allow_null=True, default=None)
    request = serializers.IntegerField(source="request_id")
    live = serializers.SerializerMethodField()

    class Meta:
        model = StandingGrant
        fields = ["id", "agent", "action", "digest", "request", "granted_by", "granted_at", "expires_at", "live",
                  "revoked_at", "revoked_by", "uses", "last_used_at"]

    def get_live(self, grant: StandingGrant) -> bool:
        return grant.live_at(timezone.now())


class StandingGrantListView(APIView):
    """The standing grants of the caller's tenant, newest first (live and ended)."""

    permission_classes = [IsHumanApprover]

    @extend_schema(responses=StandingGrantSerializer(many=True))
    def get(self, request):
        return Response(StandingGrantSerializer(grants_for_user(request.user)[:200], many=True).data)


class StandingGrantRevokeView(APIView):
    """End a standing grant now: runs rated from now on wait for a person again."""

    permission_classes = [IsHumanApprover]

    @extend_schema(request=None, responses=StandingGrantSerializer)
    def post(self, request, grant_id: int):
        grant = grants_for_user(request.user).filter(pk=grant_id).first()
        if grant is None:
            raise NotFound(f"no standing grant {grant_id}")
        return Response(StandingGrantSerializer(grant_revoke(grant, request.user)).data)
