"""The pages: one view per page, server-rendered. A live update re-renders a
named partial of the page's own template (``?fragment=`` or a row view), so
a reload and a push show the same thing. Every read is tenant-scoped
through ``runs.selectors`` (another tenant's run is a 404); every write is a
POST with a CSRF token that calls the same service as the API."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import Http404, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_POST

from pages.versions import plan_versions
from runs.dataplane import step_log_path
from runs.errors import ExecGoError
from runs.models import StepStatus
from runs.selectors import (
    RunFilters,
    hosts_overview,
    latest_event_id,
    overview_for,
    run_detail_for,
    runs_for_user,
    runs_matching,
    submitters_of,
    tenant_of,
)
from runs.services import run_cancel, run_retry
from runs.statemachine import RunState

PAGE_SIZE = 50
LOG_CHUNK_BYTES = 64 * 1024


@login_required
@require_GET
def overview(request):
    tenant = tenant_of(request.user)
    cursor = latest_event_id()  # read before the page's data: events after it are replayed live
    return render(request, "pages/overview.html", {"overview": overview_for(tenant), "live_after": cursor,
                                                   "nav": "overview"})


@login_required
@require_GET
def run_list(request):
    filters = RunFilters.from_query(request.GET)
    cursor = latest_event_id()
    page = Paginator(runs_matching(request.user, filters), PAGE_SIZE).get_page(request.GET.get("page"))
    return render(request, "pages/list.html", {
        "page": page, "filters": filters, "states": RunState.values, "agents": submitters_of(request.user),
        "live_after": cursor, "query": filters.query_string(), "nav": "runs",
    })


@login_required
@require_GET
def run_row(request, run_id: int):
    """One row of the runs list, for a live update: 204 when the run is not
    (or no longer) in the list the page shows."""
    get_object_or_404(runs_for_user(request.user), pk=run_id)  # another tenant's run is a 404, as everywhere
    filters = RunFilters.from_query(request.GET)
    run = runs_matching(request.user, filters).filter(pk=run_id).first()
    if run is None:
        return HttpResponse(status=204)
    return render(request, "pages/list.html#run-row", {"run": run})


@login_required
@require_GET
def run_detail(request, run_id: int):
    cursor = latest_event_id()
    detail = run_detail_for(request.user, run_id)
    if detail is None:
        raise Http404("no such run")
    template = "pages/detail.html#live" if request.GET.get("fragment") == "live" else "pages/detail.html"
    versions = [] if request.GET.get("fragment") == "live" else plan_versions(detail.run, detail.steps)
    return render(request, template, {"detail": detail, "run": detail.run, "live_after": cursor,
                                      "versions": versions, "nav": "runs"})


@login_required
@require_POST
def cancel(request, run_id: int):
    run = get_object_or_404(runs_for_user(request.user), pk=run_id)
    try:
        run_cancel(run=run, user=request.user)
        messages.success(request, f"Cancel requested for run {run.pk}.")
    except ExecGoError as exc:
        messages.error(request, exc.envelope["message"])
    return redirect("pages:run-detail", run_id=run.pk)


@login_required
@require_POST
def retry(request, run_id: int):
    run = get_object_or_404(runs_for_user(request.user), pk=run_id)
    try:
        new_run = run_retry(run=run, user=request.user)
    except ExecGoError as exc:
        messages.error(request, exc.envelope["message"])
        return redirect("pages:run-detail", run_id=run.pk)
    messages.success(request, f"Run {new_run.pk} retries run {run.pk}.")
    return redirect("pages:run-detail", run_id=new_run.pk)


@login_required
@require_GET
def step_log(request, run_id: int):
    """``?step=<id>&stream=stdout|stderr&offset=<n>``: a step's log from
    ``offset`` on (at most LOG_CHUNK_BYTES), for the tails that grow while a
    step runs. ``X-Log-Offset`` is where the next read starts;
    ``X-Step-Running: 0`` tells the page to stop asking."""
    run = get_object_or_404(runs_for_user(request.user), pk=run_id)
    step = get_object_or_404(run.steps.only("id", "step_id", "handle_id", "status"),
                             step_id=request.GET.get("step", ""))
    stream = request.GET.get("stream", "stdout")
    try:
        offset = max(int(request.GET.get("offset", "0")), 0)
    except ValueError:
        offset = 0
    path = step_log_path(step, stream)
    data = b""
    if path is not None:
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            if offset > size:
                offset = 0  # a new attempt started a new file
            start = max(offset, size - LOG_CHUNK_BYTES)
            fh.seek(start)
            data = fh.read(LOG_CHUNK_BYTES)
            offset = start + len(data)
    response = HttpResponse(data, content_type="text/plain; charset=utf-8")
    response["X-Log-Offset"] = str(offset)
    still_running = step.status in (StepStatus.PENDING, StepStatus.RUNNING) and not run.is_final
    response["X-Step-Running"] = "1" if still_running else "0"
    response["Cache-Control"] = "no-store"
    return response


@login_required
@require_GET
def hosts(request):
    return render(request, "pages/hosts.html", {"hosts": hosts_overview(), "nav": "hosts"})
