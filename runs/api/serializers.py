from urllib.parse import urlsplit

from django.conf import settings
from django.urls import reverse
from rest_framework import serializers

from runs.models import CALLBACK_EVENTS, Event, Job, MemoryEntry, Run, Step


class StrictSerializer(serializers.Serializer):
    """Refuses fields it does not know instead of silently dropping them."""

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            raise serializers.ValidationError({"non_field_errors": ["expected a JSON object"]})
        unknown = sorted(set(data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError({name: ["unknown field"] for name in unknown})
        return super().to_internal_value(data)


class RunCreateSerializer(StrictSerializer):
    title = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    planner = serializers.ChoiceField(choices=["static", "llm"], required=False, default="static")
    plan = serializers.JSONField(required=False)
    goal = serializers.CharField(max_length=20000, required=False, allow_blank=False)
    timeout_s = serializers.IntegerField(required=False, min_value=1, max_value=7 * 24 * 3600)
    approval_timeout_s = serializers.IntegerField(required=False, min_value=1, max_value=30 * 24 * 3600)
    callback_url = serializers.CharField(max_length=2000, required=False, allow_blank=False)
    callback_events = serializers.ListField(child=serializers.ChoiceField(choices=CALLBACK_EVENTS), required=False,
                                            allow_empty=False, max_length=len(CALLBACK_EVENTS))

    def validate_callback_url(self, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise serializers.ValidationError("must be an http(s) URL")
        if parts.hostname.lower() not in {host.lower() for host in settings.EXECGO_CALLBACK_ALLOWED_HOSTS}:
            raise serializers.ValidationError(f"host {parts.hostname!r} is not in EXECGO_CALLBACK_ALLOWED_HOSTS")
        return value

    def validate(self, attrs):
        if attrs["planner"] == "static" and "plan" not in attrs:
            raise serializers.ValidationError({"plan": ["required by the static planner"]})
        if attrs["planner"] == "llm" and "goal" not in attrs:
            raise serializers.ValidationError({"goal": ["required by the llm planner"]})
        return attrs


class PlanEvaluateSerializer(StrictSerializer):
    plan = serializers.JSONField()
    timeout_s = serializers.IntegerField(required=False, min_value=1, max_value=7 * 24 * 3600)


class PolicyEvaluationSerializer(serializers.Serializer):
    risk = serializers.ChoiceField(choices=["low", "medium", "high", "deny"])
    needs_human = serializers.BooleanField()
    rejected = serializers.BooleanField()
    policy_version = serializers.IntegerField()
    steps = serializers.ListField(child=serializers.DictField())
    matched_rules = serializers.ListField(child=serializers.DictField())
    budget = serializers.DictField()
    error = serializers.DictField(allow_null=True)


class StepSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="step_id")

    class Meta:
        model = Step
        fields = ["id", "tool", "depends_on", "status", "run_status", "handle_id", "attempt", "host", "progress",
                  "requested_plan", "effective_plan", "started_at", "finished_at", "result"]
        read_only_fields = fields


class RunSerializer(serializers.ModelSerializer):
    steps = StepSerializer(many=True, read_only=True)
    allowed_actions = serializers.SerializerMethodField()

    class Meta:
        model = Run
        fields = ["id", "job", "title", "state", "closing_cause", "retry_of", "planner", "goal", "plan", "timeout_s",
                  "approval_timeout_s", "callback_url", "callback_events",
                  "cancel_requested_at", "created_at", "last_state_change_at", "finished_at", "steps",
                  "allowed_actions"]
        read_only_fields = fields

    def get_allowed_actions(self, run: Run) -> dict:
        """What the caller can do next: cancel a run that is not final, retry
        one that is, and, while it waits for a human, where its approval is."""
        approval = None
        if run.state == "AWAITING_HITL":
            request_id = run.approval_requests.filter(status="pending").values_list("pk", flat=True).first()
            if request_id is not None:
                approval = {"page": reverse("approvals:detail", args=[request_id]),
                            "api": reverse("api-approval", args=[request_id])}
        return {
            "cancel": None if run.is_final else {"method": "POST", "url": reverse("run-cancel", args=[run.pk])},
            "retry": {"method": "POST", "url": reverse("run-retry", args=[run.pk])} if run.is_final else None,
            "approval": approval,
        }


class RunSummarySerializer(serializers.ModelSerializer):
    class Meta:
        model = Run
        fields = ["id", "job", "title", "state", "closing_cause", "retry_of", "created_at", "last_state_change_at",
                  "finished_at"]
        read_only_fields = fields


class EventSerializer(serializers.ModelSerializer):
    class Meta:
        model = Event
        fields = ["id", "type", "run_id", "task_id", "handle_id", "timestamp", "message", "data"]
        read_only_fields = fields


class JobSerializer(serializers.ModelSerializer):
    class Meta:
        model = Job
        fields = ["id", "title", "status", "run_state_snapshot", "latest_run", "created_at", "updated_at"]
        read_only_fields = fields


class MemorySerializer(serializers.ModelSerializer):
    class Meta:
        model = MemoryEntry
        fields = ["id", "run", "summary", "data", "created_at"]
        read_only_fields = fields
