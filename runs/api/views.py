"""REST API v1: one small view per action; every write calls a service."""

import time

from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import Prefetch, prefetch_related_objects
from django.http import FileResponse
from django.shortcuts import get_object_or_404
from django.urls import reverse
from django.utils import translation
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_view
from drf_spectacular.views import SpectacularAPIView
from rest_framework import generics, status
from rest_framework.exceptions import NotFound, PermissionDenied, ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from policy.interface import RuleChange, policy_dry_run, policy_replay, rule_from
from policy.models import PolicyRule
from runs.api.schema import ErrorSerializer
from runs.api.serializers import (
    EventPageSerializer,
    JobSerializer,
    MemorySerializer,
    PlanEvaluateSerializer,
    PolicyEvaluationSerializer,
    PolicyReplayRequestSerializer,
    PolicyReplaySerializer,
    RunCreateSerializer,
    RunSerializer,
    RunSummarySerializer,
)
from runs.dataplane import step_log_path
from runs.models import Run, Step, Tenant
from runs.plan_schema import find_unstorable
from runs.selectors import jobs_for_user, memories_for_user, run_events_after, runs_for_user, tenant_of
from runs.services import run_cancel, run_retry, run_submit
from runs.statemachine import RunState

LONG_POLL_INTERVAL_S = 0.2
MAX_IDEMPOTENCY_KEY_LENGTH = 200
EXAMPLE_PLAN = {"steps": [
    {"id": "greet", "tool": "shell", "params": {"argv": ["echo", "hello"]}},
    {"id": "count", "tool": "shell", "params": {"script": "echo $((40 + 2))"}, "depends_on": ["greet"]},
]}
IDEMPOTENCY_KEY = OpenApiParameter(
    "Idempotency-Key", str, OpenApiParameter.HEADER, required=False,
    description="a resubmission with the same key and body returns the first run (200); another body is 409",
    pattern=f"^[\\x20-\\x7e]{{0,{MAX_IDEMPOTENCY_KEY_LENGTH}}}$",
)


def _user_run(request, run_id: int) -> Run:
    return get_object_or_404(runs_for_user(request.user), pk=run_id)


@extend_schema_view(get=extend_schema(parameters=[
    OpenApiParameter("state", str, enum=RunState.values, required=False, description="only runs in this state"),
]))
class RunListCreateView(generics.ListAPIView):
    serializer_class = RunSummarySerializer

    def get_queryset(self):
        runs = runs_for_user(self.request.user).order_by("-id")
        state = self.request.query_params.get("state")
        if state is not None:
            if state not in RunState.values:
                raise ValidationError({"state": [f"unknown state {state!r}"]})
            runs = runs.filter(state=state)
        return runs

    @extend_schema(
        request=RunCreateSerializer,
        responses={201: RunSerializer, 200: RunSerializer},
        parameters=[IDEMPOTENCY_KEY],
        examples=[OpenApiExample("two shell steps", request_only=True, value={"title": "hello", "plan": EXAMPLE_PLAN}),
                  OpenApiExample("a file write", request_only=True, value={"plan": {"steps": [
                      {"id": "note", "tool": "file", "params": {"op": "write", "path": "note.txt",
                                                                 "content": "hello"}}]}, "timeout_s": 60})],
    )
    def post(self, request):
        tenant = tenant_of(request.user)
        if tenant is None:
            raise PermissionDenied("this account belongs to no tenant")
        serializer = RunCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        key = request.headers.get("Idempotency-Key") or None
        if key is not None and not (key.isascii() and key.isprintable() and len(key) <= MAX_IDEMPOTENCY_KEY_LENGTH):
            raise ValidationError({"Idempotency-Key": [
                f"at most {MAX_IDEMPOTENCY_KEY_LENGTH} printable ASCII characters"]})
        submission = run_submit(tenant=tenant, user=request.user, idempotency_key=key, **serializer.validated_data)
        if submission.created:
            # The answer is the run as committed: no steps yet (a worker makes
            # them when it plans the run), so they are not read.
            prefetch_related_objects([submission.run], Prefetch("steps", queryset=Step.objects.none()))
        return Response(RunSerializer(submission.run).data,
                        status=status.HTTP_201_CREATED if submission.created else status.HTTP_200_OK)


class RunDetailView(APIView):
    @extend_schema(responses=RunSerializer)
    def get(self, request, run_id: int):
        run = get_object_or_404(runs_for_user(request.user).prefetch_related("steps"), pk=run_id)
        return Response(RunSerializer(run).data)


class RunCancelView(APIView):
    @extend_schema(request=None, responses={
        202: RunSerializer,
        409: OpenApiResponse(ErrorSerializer, description="the run is final or its ending is already decided: "
                                                          "nothing stored, the refusal audited"),
    })
    def post(self, request, run_id: int):
        run = run_cancel(run=_user_run(request, run_id), user=request.user)
        return Response(RunSerializer(run).data, status=status.HTTP_202_ACCEPTED)


class RunRetryView(APIView):
    @extend_schema(request=None, responses={201: RunSerializer})
    def post(self, request, run_id: int):
        run = run_retry(run=_user_run(request, run_id), user=request.user)
        return Response(RunSerializer(run).data, status=status.HTTP_201_CREATED)


MAX_CURSOR = 2**63 - 1  # the largest id a bigint holds


def _non_negative_int(request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    # ASCII digits only: int() would also take "\u0663", " 1" and "1_000".
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 19 or int(raw) > MAX_CURSOR:
        raise ValidationError({name: [f"must be an integer from 0 to {MAX_CURSOR}"]})
    return int(raw)


class RunEventsView(APIView):
    @extend_schema(
        parameters=[
            OpenApiParameter("after", {"type": "integer", "minimum": 0, "maximum": MAX_CURSOR},
                             description="return events with an id greater than this (default 0)"),
            OpenApiParameter("wait", {"type": "integer", "minimum": 0, "maximum": MAX_CURSOR},
                             description="long-poll: seconds to wait for a first event (default 0); "
                                         "more than EXECGO_API_LONG_POLL_MAX_S (30) waits that long"),
        ],
        responses=EventPageSerializer,
    )
    def get(self, request, run_id: int):
        run = _user_run(request, run_id)
        after = _non_negative_int(request, "after", 0)
        wait_s = min(_non_negative_int(request, "wait", 0), settings.EXECGO_API_LONG_POLL_MAX_S)
        deadline = time.monotonic() + wait_s
        events = run_events_after(run, after)
        while not events and (remaining := deadline - time.monotonic()) > 0:
            time.sleep(min(LONG_POLL_INTERVAL_S, remaining))
            events = run_events_after(run, after)
        return Response(EventPageSerializer({
            "run_id": run.pk, "events": events, "last_event_id": events[-1].pk if events else after,
        }).data)


class StepLogView(APIView):
    """The full stdout/stderr of a step's latest attempt, while the retention
    GC has not removed it (the result envelope keeps a capped tail forever)."""

    @extend_schema(responses={(200, "text/plain"): bytes}, parameters=[
        OpenApiParameter("stream", str, OpenApiParameter.PATH, enum=["stdout", "stderr"]),
    ])
    def get(self, request, run_id: int, step_id: str, stream: str):
        run = _user_run(request, run_id)
        if find_unstorable(step_id) is not None:  # no step can have that id; the database would refuse the query
            raise NotFound(f"no step {step_id!r}")
        step = get_object_or_404(run.steps.all(), step_id=step_id)
        path = step_log_path(step, stream)
        if path is None:
            raise NotFound(f"no {stream} log for step {step_id!r} (never started, not a shell step, or purged)")
        response = FileResponse(open(path, "rb"), content_type="text/plain; charset=utf-8")
        response["Content-Disposition"] = f'inline; filename="{step.handle_id}-{stream}.log"'
        return response


class PolicyEvaluateView(APIView):
    """A dry run of POLICY_CHECK: the same rating of a plan, without a run,
    a trace or an audit row."""

    @extend_schema(request=PlanEvaluateSerializer, responses=PolicyEvaluationSerializer, examples=[
        OpenApiExample("two shell steps", request_only=True, value={"plan": EXAMPLE_PLAN})])
    def post(self, request):
        tenant = tenant_of(request.user)
        if tenant is None:
            raise PermissionDenied("this account belongs to no tenant")
        body = PlanEvaluateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        decision = policy_dry_run(plan=body.validated_data["plan"], tenant=tenant,
                                  timeout_s=body.validated_data.get("timeout_s"))
        return Response({
            "risk": decision.risk, "needs_human": decision.risk == "high", "rejected": decision.rejected,
            "policy_version": decision.data["policy_version"], "steps": decision.data["steps"],
            "matched_rules": decision.data["matched_rules"], "budget": decision.data["budget"],
            "error": decision.error,
        })


class PolicyReplayView(APIView):
    """What-if replay of one rule change over the stored plans of the last
    ``limit`` runs (docs/policy.md#what-if-replay): which steps' and runs'
    risks would change. Nothing is saved and nothing runs. Staff only: a
    tenant's staff replay their own rules over their tenant's runs; the
    superuser any rule, over one tenant's runs or every tenant's."""

    @extend_schema(request=PolicyReplayRequestSerializer, responses=PolicyReplaySerializer)
    def post(self, request):
        user = request.user
        if not user.is_staff or user.groups.filter(name="agents").exists():
            raise PermissionDenied("a what-if replay is for staff")
        body = PolicyReplayRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        tenant_id = self._tenant_id(user, data)
        visible = PolicyRule.objects.all() if user.is_superuser else PolicyRule.objects.filter(tenant_id=tenant_id)
        try:
            if "delete" in data:
                before = visible.filter(pk=data["delete"]).first()
                if before is None:
                    raise NotFound(f"no policy rule {data['delete']}")
                change = RuleChange(before=before, after=None)
            else:
                values = dict(data["rule"])
                rule_id = values.pop("id", None)
                before = visible.filter(pk=rule_id).first() if rule_id is not None else None
                if rule_id is not None and before is None:
                    raise NotFound(f"no policy rule {rule_id}")
                change = RuleChange(before=before, after=rule_from(values, base=before, tenant_id=tenant_id))
            report = policy_replay(change, tenant_id=tenant_id, limit=data["limit"])
        except DjangoValidationError as exc:
            raise ValidationError({"rule": exc.messages if not hasattr(exc, "error_dict") else exc.message_dict})
        return Response(PolicyReplaySerializer({
            "tenant": tenant_id, "runs": report.runs, "steps": report.steps, "elapsed_ms": report.elapsed_ms,
            "counts": report.counts(), "flips": [_flip_row(item) for item in report.flips],
            "runs_changed": [_flip_row(item) for item in report.run_flips]}).data)

    @staticmethod
    def _tenant_id(user, data) -> int | None:
        if user.is_superuser:
            tenant_id = data.get("tenant")
            if tenant_id is not None and not Tenant.objects.filter(pk=tenant_id).exists():
                raise NotFound(f"no tenant {tenant_id}")
            return tenant_id
        tenant = tenant_of(user)
        if tenant is None:
            raise PermissionDenied("this account belongs to no tenant")
        if data.get("tenant") not in (None, tenant.pk):
            raise PermissionDenied("staff replay over their own tenant's runs only")
        return tenant.pk


def _flip_row(flip) -> dict:
    return {"run_id": flip.run_id, "step_id": flip.step_id, "before": flip.before, "after": flip.after,
            "reasons": list(flip.reasons), "run_url": reverse("pages:run-detail", args=[flip.run_id])}


class JobDetailView(APIView):
    @extend_schema(responses=JobSerializer)
    def get(self, request, job_id: int):
        return Response(JobSerializer(get_object_or_404(jobs_for_user(request.user), pk=job_id)).data)


class MemoryListView(generics.ListAPIView):
    serializer_class = MemorySerializer

    def get_queryset(self):
        return memories_for_user(self.request.user).order_by("-id")


class SchemaView(SpectacularAPIView):
    """``/api/v1/schema/``: the OpenAPI schema, the same for every caller of
    one deployment (public: not filtered by who asks), generated once a
    process for each version and language asked for rather than on every
    request (seconds of CPU each time)."""

    _generated: dict[tuple[str | None, str | None], dict] = {}

    def _get_schema_response(self, request):
        version = self.api_version or request.version or self._get_version_parameter(request)
        key = (version, translation.get_language())
        schema = self._generated.get(key)
        if schema is None:
            generator = self.generator_class(urlconf=self.urlconf, api_version=version, patterns=self.patterns)
            schema = self._generated[key] = generator.get_schema(request=request, public=True)
        return Response(data=schema, headers={
            "Content-Disposition": f'inline; filename="{self._get_filename(request, version)}"'})
