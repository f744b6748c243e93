from rest_framework import serializers

from runs.models import Event, Job, MemoryEntry, Run, Step


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

    def validate(self, attrs):
        if attrs["planner"] == "static" and "plan" not in attrs:
            raise serializers.ValidationError({"plan": ["required by the static planner"]})
        if attrs["planner"] == "llm" and "goal" not in attrs:
            raise serializers.ValidationError({"goal": ["required by the llm planner"]})
        return attrs


class StepSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="step_id")

    class Meta:
        model = Step
        fields = ["id", "tool", "depends_on", "status", "run_status", "handle_id", "attempt", "host", "progress",
                  "requested_plan", "effective_plan", "started_at", "finished_at", "result"]
        read_only_fields = fields


class RunSerializer(serializers.ModelSerializer):
    steps = StepSerializer(many=True, read_only=True)

    class Meta:
        model = Run
        fields = ["id", "job", "title", "state", "closing_cause", "retry_of", "planner", "goal", "plan", "timeout_s",
                  "approval_timeout_s",
                  "cancel_requested_at", "created_at", "last_state_change_at", "finished_at", "steps"]
        read_only_fields = fields


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
