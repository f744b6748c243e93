import pytest
from django.utils import timezone

from runs.dataplane import current_host, new_handle_id, resolve_step_plan
from runs.models import Step, StepRunStatus, StepStatus
from tests.runs.admin_helpers import add_run


@pytest.fixture
def run(tenant, agent):
    """The run of the Django admin's tests (test_admin_*.py): EXECUTING, with
    one step, trace, audit row and event (admin_helpers.add_run)."""
    return add_run(tenant, agent, "EXECUTING", title="nightly backup")


def start_attempt(step: Step, *, attempt: int = 1) -> Step:
    """Test factory: mark ``step``'s attempt (the first by default) as
    running on this host, as settle's claim does (handle, host, effective
    plan, start time), and return it re-read with its run."""
    Step.objects.filter(pk=step.pk).update(
        status=StepStatus.RUNNING, run_status=StepRunStatus.RUNNING, attempt=attempt,
        handle_id=new_handle_id(step, attempt),
        host=current_host(), effective_plan=resolve_step_plan(step), started_at=timezone.now(),
    )
    return Step.objects.select_related("run").get(pk=step.pk)
