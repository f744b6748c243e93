import pytest

from runs.models import Run, Step


@pytest.fixture
def run_with(make_run):
    """A run in POLICY_CHECK holding ``steps`` (s0, s1, … in plan order)."""

    def factory(*steps: dict, timeout_s: int = 600) -> Run:
        run = make_run("POLICY_CHECK", previous_state="PLANNING", timeout_s=timeout_s)
        Step.objects.bulk_create(
            Step(run=run, step_id=f"s{position}", position=position, tool=step["tool"], params=step["params"],
                 timeout_s=step.get("timeout_s", 10), retries=step.get("retries", 0),
                 depends_on=step.get("depends_on", []), requested_plan=step.get("sandbox", {}))
            for position, step in enumerate(steps)
        )
        return run

    return factory
