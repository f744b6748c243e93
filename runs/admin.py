"""The operators' view of the kernel: browse, search, filter — and cancel.

Nothing here writes a run's state or its history. ``Run.state`` is moved
only by ``runs.transitions.run_transition``; every other Run column is
written by a service too, so the Run admin is view-only and its one write,
"Cancel selected runs", calls ``runs.services.run_cancel``. Traces, the
audit log and the event outbox are append-only records: no add, change or
delete here, not even for superusers. ``Job.status`` and
``Job.run_state_snapshot`` are the projector's, so they are read-only.

JSON columns are shown as indented JSON, never as inputs (the helpers, shared
with the runtime admin, live in ``runtime.admin``).

Every admin here is tenant-scoped or superuser-only (``runs.admin_scope``);
so are tenants, memberships and Django's users and groups, registered again
(``runs.admin_people``), and the API tokens (``runs.admin_tokens``). Changes to tenants, memberships, users and groups
are audited (``runs.admin_audit``); the policy's admin is the policy app's.
"""

from django.contrib import admin, messages
from django.urls import reverse
from django.utils.html import format_html

from runs import admin_people, admin_tokens  # noqa: F401  (register the people's and the API tokens' admins)
from runs.admin_scope import ReadOnlyAdminMixin, TenantScopedAdmin
from runs.errors import ExecGoError
from runs.models import (
    AuditLog,
    Event,
    Job,
    MemoryEntry,
    Run,
    Step,
    Trace,
    WebhookDelivery,
)
from runs.services import run_cancel
from runs.statemachine import display_group
from runs.transitions import TransitionLost
from runtime.admin import PrettyJSONMixin, badge


def change_link(model_name: str, pk, text):
    return format_html('<a href="{}">{}</a>', reverse(f"admin:runs_{model_name}_change", args=[pk]), text)


# Display callables shared by the lists and the inlines. Each reads only the
# row and what the admin's select_related already joined, so a list page
# costs the same number of queries for 2 rows as for 100.


@admin.display(description="state", ordering="state")
def run_state(run: Run):
    return badge(run.state, display_group(run.state))  # the pages' colours


@admin.display(description="status", ordering="status")
def job_status(job: Job):
    return badge(job.status, f"job-{job.status}")


@admin.display(description="status", ordering="status")
def step_status(step: Step):
    return badge(step.status, f"step-{step.status}")


@admin.display(description="job", ordering="job_id")
def run_job(run: Run):
    return change_link("job", run.job_id, run.job)


@admin.display(description="retry of", ordering="retry_of_id")
def run_retry_of(run: Run):
    # Named by its id: joining the retried run would load its plan and context.
    return change_link("run", run.retry_of_id, f"Run {run.retry_of_id}") if run.retry_of_id else None


@admin.display(description="latest run", ordering="latest_run_id")
def job_latest_run(job: Job):
    return change_link("run", job.latest_run_id, job.latest_run) if job.latest_run_id else None


# A delivery's status in the colours of the step it most resembles.
WEBHOOK_BADGES = {"pending": "step-pending", "delivered": "step-success", "failed": "step-failed"}


@admin.display(description="status", ordering="status")
def webhook_status(delivery: WebhookDelivery):
    return badge(delivery.status, WEBHOOK_BADGES.get(delivery.status, "step-pending"))


@admin.display(description="run", ordering="run_id")
def record_run(record):
    """The run a step, trace, audit row, event, memory or webhook belongs to."""
    if record.run_id is None:
        return None
    try:
        run = record.run
    except Run.DoesNotExist:
        run = None
    if run is None:
        # An audit row has no constraint on its run: the run's insert may
        # have rolled back, so there is nothing to link to.
        return f"Run {record.run_id} (not stored)"
    return change_link("run", run.pk, run)


class ReadOnlyInline(ReadOnlyAdminMixin, admin.TabularInline):
    extra = 0
    can_delete = False
    show_change_link = True


# --- jobs and runs -----------------------------------------------------------


class JobRunInline(ReadOnlyInline):
    model = Run
    fk_name = "job"
    # Each row's "View" link (show_change_link) opens the run's own page.
    fields = (run_state, "closing_cause", run_retry_of, "submitted_by", "created_at", "finished_at")
    readonly_fields = fields
    ordering = ("id",)

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("submitted_by")


@admin.register(Job)
class JobAdmin(TenantScopedAdmin, PrettyJSONMixin, admin.ModelAdmin):
    tenant_path = "tenant"

    list_display = ("id", "title", "tenant", job_status, job_latest_run, "created_by", "created_at", "updated_at")
    list_display_links = ("id", "title")
    list_select_related = ("tenant", "latest_run", "created_by")
    search_fields = ("id__exact", "title", "created_by__username", "tenant__name")
    list_filter = ("status", "tenant", "created_at")
    fields = ("title", "tenant", "created_by", "status", "latest_run", "run_state_snapshot", "created_at",
              "updated_at")
    # status and run_state_snapshot are the projection of the latest run's
    # state; latest_run and tenant are the kernel's bookkeeping.
    readonly_fields = ("tenant", "created_by", "status", "latest_run", "run_state_snapshot", "created_at",
                       "updated_at")
    inlines = (JobRunInline,)

    def has_add_permission(self, request) -> bool:
        return False  # a job comes into being with its first run (runs.services.run_submit)

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # runs, traces and audit rows are kept (docs/data-plane.md#retention)

    def save_model(self, request, obj, form, change):
        # A plain save() writes every column from the copy loaded when the
        # form was opened, which would put back a Job.status the projector
        # has since moved on. Write only what the form changed.
        if form.changed_data:
            obj.save(update_fields=[*form.changed_data, "updated_at"])


class StepInline(ReadOnlyInline):
    model = Step
    fields = ("step_id", "position", "tool", step_status, "run_status", "attempt", "handle_id", "host", "started_at",
              "finished_at")
    readonly_fields = fields


class TraceInline(ReadOnlyInline):
    model = Trace
    fields = ("kind", "from_state", "to_state", "step", "data", "error", "created_at")
    readonly_fields = fields

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("step")


class AuditLogInline(ReadOnlyInline):
    model = AuditLog
    fields = ("event", "actor", "caller", "forced_by", "from_state", "to_state", "data", "created_at")
    readonly_fields = fields

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("actor")


@admin.register(Run)
class RunAdmin(TenantScopedAdmin, ReadOnlyAdminMixin, admin.ModelAdmin):
    tenant_path = "tenant"

    list_display = ("id", "title", run_state, "closing_cause", "tenant", "submitted_by", run_job, run_retry_of,
                    "created_at", "last_state_change_at", "cancel_requested_at")
    list_display_links = ("id", "title")
    list_select_related = ("tenant", "submitted_by", "job")
    search_fields = ("id__exact", "title", "goal", "idempotency_key", "submitted_by__username", "tenant__name")
    list_filter = ("state", "closing_cause", "planner", "tenant", "created_at")
    fieldsets = (
        (None, {"fields": ("title", "tenant", "job", "submitted_by", "retry_of")}),
        ("State", {"fields": ("state", "previous_state", "closing_cause", "created_at", "last_state_change_at",
                              "executing_started_at", "finished_at")}),
        ("Cancellation", {"fields": ("cancel_requested_at", "cancel_requested_by")}),
        ("Plan", {"fields": ("planner", "goal", "plan", "submitted_plan", "timeout_s", "approval_timeout_s",
                             "idempotency_key", "context")}),
        ("Sweeper", {"fields": ("resends", "resent_at")}),
        ("Callback", {"fields": ("callback_url", "callback_events")}),
    )
    # Spelled out, not only implied by the missing change permission, so that
    # granting one later can never make the state an input.
    readonly_fields = tuple(field for _, options in fieldsets for field in options["fields"])
    inlines = (StepInline, TraceInline, AuditLogInline)
    actions = ("cancel_runs",)

    def has_cancel_permission(self, request) -> bool:
        return request.user.has_perm("runs.change_run")

    @admin.action(description="Cancel selected runs", permissions=["cancel"])
    def cancel_runs(self, request, queryset):
        requested, refused = [], []
        for run in queryset.order_by("id"):
            try:
                run = run_cancel(run=run, user=request.user, caller="admin")
            except ExecGoError as exc:
                refused.append(f"run {run.pk}: {exc.envelope['message']}")
            except TransitionLost as lost:
                # Another writer moved the run while it was being closed; the
                # stored request still stands and the audit log has both.
                refused.append(f"run {run.pk}: cancel request stored, but {lost}")
            else:
                requested.append(f"{run.pk} ({run.state})")
        if requested:
            self.message_user(request, f"Cancel requested for {len(requested)} run(s): {', '.join(requested)}",
                              messages.SUCCESS)
        for message in refused:
            self.message_user(request, f"Not cancelled — {message}", messages.ERROR)


@admin.register(Step)
class StepAdmin(TenantScopedAdmin, ReadOnlyAdminMixin, admin.ModelAdmin):
    tenant_path = "run__tenant"

    list_display = ("step_id", record_run, "tool", step_status, "run_status", "attempt", "handle_id", "started_at",
                    "finished_at")
    list_select_related = ("run",)
    search_fields = ("step_id", "handle_id", "run__id__exact")
    list_filter = ("status", "run_status", "tool", "run__tenant", "started_at")
    inlines = (TraceInline,)


# --- append-only records ------------------------------------------------------


@admin.register(Trace)
class TraceAdmin(TenantScopedAdmin, ReadOnlyAdminMixin, admin.ModelAdmin):
    tenant_path = "run__tenant"

    list_display = ("id", record_run, "kind", "from_state", "to_state", "step", "created_at")
    list_select_related = ("run", "step")
    search_fields = ("run__id__exact", "kind", "from_state", "to_state")
    list_filter = ("kind", "run__tenant", "created_at")
    show_full_result_count = False  # append-only and large: skip the unfiltered COUNT(*)


@admin.register(AuditLog)
class AuditLogAdmin(TenantScopedAdmin, ReadOnlyAdminMixin, admin.ModelAdmin):
    tenant_path = "tenant"

    list_display = ("id", "event", record_run, "tenant", "actor", "caller", "forced_by", "from_state", "to_state",
                    "created_at")
    list_select_related = ("run", "tenant", "actor")
    search_fields = ("event", "caller", "actor__username", "run__id__exact")
    list_filter = ("event", "forced_by", "tenant", "created_at")
    show_full_result_count = False

    def get_queryset(self, request):
        # run and tenant carry no database constraint (an audit row may name
        # a run whose insert rolled back); the outer join shows those as empty.
        return super().get_queryset(request).select_related("run", "tenant", "actor")


@admin.register(Event)
class EventAdmin(TenantScopedAdmin, ReadOnlyAdminMixin, admin.ModelAdmin):
    tenant_path = "run__tenant"

    list_display = ("id", "type", record_run, "task_id", "handle_id", "timestamp", "message")
    list_select_related = ("run",)
    search_fields = ("run__id__exact", "task_id", "handle_id", "message")
    list_filter = ("type", "run__tenant", "timestamp")
    show_full_result_count = False


@admin.register(MemoryEntry)
class MemoryEntryAdmin(TenantScopedAdmin, PrettyJSONMixin, admin.ModelAdmin):
    """Written only by the tracer of a SUCCEEDED run; an operator may delete
    an entry (it is then never recalled again), never edit one."""

    tenant_path = "tenant"

    list_display = ("id", "tenant", "agent", record_run, "summary", "created_at")
    list_select_related = ("tenant", "agent", "run")
    search_fields = ("summary", "agent__username", "run__id__exact")
    list_filter = ("tenant", "created_at")
    readonly_fields = ("tenant", "agent", "run", "summary", "data", "created_at")

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(TenantScopedAdmin, ReadOnlyAdminMixin, admin.ModelAdmin):
    """Written and updated only by runs.webhooks (the notification, then each
    attempt); an operator reads why a receiver did not get one."""

    tenant_path = "tenant"

    list_display = ("id", "event", webhook_status, "attempts", "last_status_code", "url", record_run, "tenant",
                    "created_at", "delivered_at")
    list_select_related = ("run", "tenant")
    search_fields = ("event", "url")
    list_filter = ("status", "event", "created_at")
    show_full_result_count = False
