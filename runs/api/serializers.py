from urllib.parse import urlsplit

from django.conf import settings
from django.urls import reverse
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from policy.interface import DEFAULT_RUNS as REPLAY_DEFAULT_RUNS
from policy.interface import MAX_RUNS as REPLAY_MAX_RUNS
from runs.models import CALLBACK_EVENTS, Event, EventType, Job, MemoryEntry, Run, Step, StepRunStatus
from runs.plan_schema import KNOWN_TOOLS, MAX_RETRIES, MAX_STEP_ID_LENGTH, STEP_KEYS
from runs.services import cancel_would_apply
from runs.statemachine import ClosingCause
from runtime.plan_resolver import MODES, PROFILES


def plan_json_schema() -> dict:
    """What ``runs.plan_schema.validate_plan`` checks, as far as JSON Schema
    can say it (unique ids, known dependencies, no cycle and each tool's
    params are checked there and answered with a 400)."""
    step = {
        "type": "object",
        "required": ["id", "tool"],
        "additionalProperties": False,
        "properties": {
            "id": {"type": "string", "minLength": 1, "maxLength": MAX_STEP_ID_LENGTH},
            "tool": {"type": "string", "enum": list(KNOWN_TOOLS)},
            "params": {"type": "object", "description": "shell: argv | script, cwd?, env?, stdin?; "
                                                        "http: method, url, headers?, body?, timeout_s?; "
                                                        "file: op, path, content?"},
            "depends_on": {"type": "array", "items": {"type": "string"}},
            "timeout_s": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 86400},
            "retries": {"type": "integer", "minimum": 0, "maximum": MAX_RETRIES},
            "sandbox": {"type": "object", "additionalProperties": False, "properties": {
                "profile": {"type": "string", "enum": list(PROFILES)},
                "mode": {"type": "string", "enum": list(MODES)},
                "limits": {"type": "object"},
            }},
        },
    }
    assert set(step["properties"]) == STEP_KEYS
    return {"type": "object", "required": ["steps"], "additionalProperties": False, "properties": {
        "steps": {"type": "array", "minItems": 1, "maxItems": settings.EXECGO_MAX_PLAN_STEPS, "items": step}}}


@extend_schema_field(plan_json_schema())
class PlanField(serializers.JSONField):
    """A plan: an object (never null); its contents are validated by
    ``validate_plan`` where it is used."""

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            raise serializers.ValidationError("must be an object with a 'steps' list")
        return super().to_internal_value(data)


def _json_type_error(field: serializers.Field, value) -> str | None:
    """DRF coerces (0 to "0" for a CharField, "5" to 5 for an
    IntegerField); the schema promises JSON types, so they are held to."""
    if value is None:
        return None  # allow_null decides
    if isinstance(field, (serializers.CharField, serializers.ChoiceField)) and not isinstance(value, str):
        return "must be a string"
    if isinstance(field, serializers.IntegerField) and (isinstance(value, bool) or not isinstance(value, int)):
        return "must be an integer"
    if isinstance(field, serializers.ListField) and not isinstance(value, list):
        return "must be a list"
    if isinstance(field, serializers.ListField) and isinstance(field.child, serializers.ChoiceField):
        if not all(isinstance(item, str) for item in value):
            return "must be a list of strings"
    return None


class StringField(serializers.CharField):
    """A CharField that takes a JSON string only (DRF's turns 0 into "0")."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictSerializer(serializers.Serializer):
    """Refuses fields it does not know instead of silently dropping them,
    and values of another JSON type than the field's."""

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            raise serializers.ValidationError({"non_field_errors": ["expected a JSON object"]})
        unknown = sorted(set(data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError({name: ["unknown field"] for name in unknown})
        wrong = {name: [error] for name, value in data.items()
                 if (error := _json_type_error(self.fields[name], value)) is not None}
        if wrong:
            raise serializers.ValidationError(wrong)
        return super().to_internal_value(data)


class RunCreateSerializer(StrictSerializer):
    """A run to submit: a plan (the static planner) or a goal (the llm planner)."""

    title = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    planner = serializers.ChoiceField(choices=["static", "llm"], required=False, default="static")
    plan = PlanField(required=False)
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
    """A plan to rate as POLICY_CHECK would, without a run."""

    plan = PlanField()
    timeout_s = serializers.IntegerField(required=False, min_value=1, max_value=7 * 24 * 3600)


class ReplayRuleSerializer(StrictSerializer):
    """A rule as it would be saved: with ``id``, a change of that rule (the
    fields given replace its own); without, a new rule."""

    id = serializers.IntegerField(required=False, min_value=1, max_value=2**63 - 1)
    name = serializers.CharField(required=False, max_length=100)
    tool = serializers.CharField(required=False, max_length=20)
    field = serializers.CharField(required=False, max_length=10)
    pattern = serializers.CharField(required=False, max_length=500)
    negate = serializers.BooleanField(required=False)
    outcome = serializers.ChoiceField(required=False, choices=["low", "medium", "high", "deny"])
    reason = serializers.CharField(required=False, max_length=300)
    enabled = serializers.BooleanField(required=False)
    priority = serializers.IntegerField(required=False, min_value=-(2**31), max_value=2**31 - 1)
    approvals_required = serializers.IntegerField(required=False, min_value=1, max_value=32767)


class PolicyReplayRequestSerializer(StrictSerializer):
    """One rule change: ``rule`` (added or changed) or ``delete`` (a rule's id)."""

    rule = ReplayRuleSerializer(required=False)
    delete = serializers.IntegerField(required=False, min_value=1, max_value=2**63 - 1)
    tenant = serializers.IntegerField(required=False, min_value=1, max_value=2**63 - 1, allow_null=True,
                                      help_text="the superuser's: whose runs (default: every tenant's)")
    limit = serializers.IntegerField(required=False, default=REPLAY_DEFAULT_RUNS, min_value=1,
                                     max_value=REPLAY_MAX_RUNS,
                                     help_text=f"the last N runs replayed (default {REPLAY_DEFAULT_RUNS})")

    def validate(self, data):
        if ("rule" in data) == ("delete" in data):
            raise serializers.ValidationError({"rule": ["give one change: a rule, or the id of one to delete"]})
        return data


class ReplayFlipSerializer(serializers.Serializer):
    run_id = serializers.IntegerField()
    step_id = serializers.CharField(allow_null=True)
    before = serializers.CharField()
    after = serializers.CharField()
    reasons = serializers.ListField(child=serializers.CharField())
    run_url = serializers.CharField()


class PolicyReplaySerializer(serializers.Serializer):
    tenant = serializers.IntegerField(allow_null=True)
    runs = serializers.IntegerField(help_text="runs replayed")
    steps = serializers.IntegerField(help_text="steps of those runs")
    elapsed_ms = serializers.FloatField()
    counts = serializers.DictField(child=serializers.IntegerField(), help_text='steps flipped each way, '
                                                                                 'e.g. {"low → high": 3}')
    flips = ReplayFlipSerializer(many=True, help_text="every step whose risk would change")
    runs_changed = ReplayFlipSerializer(many=True, help_text="every run whose overall risk would change")


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
    # Empty until the step's first execution is accepted.
    run_status = serializers.ChoiceField(choices=StepRunStatus.choices, allow_blank=True, read_only=True)

    class Meta:
        model = Step
        fields = ["id", "tool", "depends_on", "status", "run_status", "handle_id", "attempt", "host", "progress",
                  "requested_plan", "rated_plan", "effective_plan", "started_at", "finished_at", "result"]
        read_only_fields = fields


def _closing_cause_field():
    # Empty until the run enters TRACING.
    return serializers.ChoiceField(choices=ClosingCause.choices, allow_blank=True, read_only=True)


class RunSerializer(serializers.ModelSerializer):
    steps = StepSerializer(many=True, read_only=True)
    closing_cause = _closing_cause_field()
    allowed_actions = serializers.SerializerMethodField()

    class Meta:
        model = Run
        fields = ["id", "job", "title", "state", "closing_cause", "retry_of", "planner", "goal", "plan",
                  "submitted_plan", "timeout_s", "approval_timeout_s", "callback_url", "callback_events",
                  "cancel_requested_at", "created_at", "last_state_change_at", "finished_at", "steps",
                  "allowed_actions"]
        read_only_fields = fields

    def get_allowed_actions(self, run: Run) -> dict:
        """What the caller can do next: cancel a run whose ending is not yet
        decided, retry one that is final, and, while it waits for a human,
        where its approval is."""
        approval = None
        if run.state == "AWAITING_HITL":
            request_id = run.approval_requests.filter(status="pending").values_list("pk", flat=True).first()
            if request_id is not None:
                approval = {"page": reverse("approvals:detail", args=[request_id]),
                            "api": reverse("api-approval", args=[request_id])}
        return {
            "cancel": ({"method": "POST", "url": reverse("run-cancel", args=[run.pk])}
                       if cancel_would_apply(run) else None),
            "retry": {"method": "POST", "url": reverse("run-retry", args=[run.pk])} if run.is_final else None,
            "approval": approval,
        }


class RunSummarySerializer(serializers.ModelSerializer):
    closing_cause = _closing_cause_field()

    class Meta:
        model = Run
        fields = ["id", "job", "title", "state", "closing_cause", "retry_of", "created_at", "last_state_change_at",
                  "finished_at"]
        read_only_fields = fields


class EventSerializer(serializers.ModelSerializer):
    type = serializers.ChoiceField(choices=EventType.choices, read_only=True)

    class Meta:
        model = Event
        fields = ["id", "type", "run_id", "task_id", "handle_id", "timestamp", "message", "data"]
        read_only_fields = fields


class EventPageSerializer(serializers.Serializer):
    """``GET runs/{id}/events``: the run's events after the cursor, and the
    cursor to pass as ``after`` next time."""

    run_id = serializers.IntegerField()
    events = EventSerializer(many=True)
    last_event_id = serializers.IntegerField(min_value=0)


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
