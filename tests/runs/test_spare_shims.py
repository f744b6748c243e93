"""A sequential chain starts each next step in a spare shim, forked while
the previous step ran and its result was being recorded, with the next
step's sandbox set up there ahead (pre-started), and its first step in one
forked once the policy let the run execute; a spare that no step takes
never outlives the chain, and never runs the step it was told of."""

import json
import threading
import time
import uuid
from dataclasses import replace

import psutil
import pytest
from django.utils import timezone

import runs.pipeline
import runs.settle
from runs.execution import execute_claims, step_finish
from runs.models import Run, Step, StepRunStatus, StepStatus
from runs.pipeline import run_advance
from runs.services import run_submit
from runtime import executor, forkserver, layout
from runtime.capabilities import capability_manifest
from tests.conftest import simple_plan, wait_until
from tests.runs.conftest import start_attempt

pytestmark = pytest.mark.django_db(transaction=True)


def shims_of_the_fork_server() -> list[psutil.Process]:
    pid = forkserver.server_pid(str(layout.tasks_dir()))
    if pid is None:
        return []
    return [child for child in psutil.Process(pid).children() if child.status() != psutil.STATUS_ZOMBIE]


def test_each_next_step_of_a_chain_starts_in_a_spare(tenant, agent):
    # Up, as a worker's earlier steps left it (a spare never starts the server).
    forkserver.start_server(layout.shim_python(), str(layout.tasks_dir()), 600)
    run = run_submit(tenant=tenant, user=agent, plan=simple_plan(*[["true"]] * 5)).run

    execute_claims(run_advance(run.pk))

    assert Run.objects.get(pk=run.pk).state == "SUCCEEDED"
    started = [json.loads((layout.task_dir(handle) / "launch.json").read_text())["via"]
               for handle in Step.objects.filter(run=run).order_by("position").values_list("handle_id", flat=True)]
    # The first step's too: forked once the policy let the run execute.
    assert started == ["spare"] * 5
    if capability_manifest()["bubblewrap"]["available"]:  # the default profile is linux_sandbox: pre-started
        assert [step.result["details"]["started_by"] for step in Step.objects.filter(run=run).order_by("position")
                ] == ["prestart"] * 5
    wait_until(lambda: shims_of_the_fork_server() == [], what="every shim and spare gone")


def commands_named(marker: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[0] == "sleep"
            and any(marker in part for part in p.info["cmdline"])]


def gates_for(marker: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if "execgo-gate" in (p.info["cmdline"] or ())
            and any(marker in part for part in p.info["cmdline"])]


def made_since(started: float, step: Step) -> list:
    """The task directories of ``step`` made since ``started`` (a flushed
    SQLite table reuses step ids: an earlier test's may carry the same). A
    file's time comes from a coarser clock, up to a tick behind: the slack."""
    return [path for path in layout.tasks_dir().glob(f"h-{step.pk}-*") if path.stat().st_mtime >= started - 0.05]


needs_bubblewrap = pytest.mark.skipif(not capability_manifest()["bubblewrap"]["available"],
                                      reason="pre-starting is for bubblewrap sandboxes")


@needs_bubblewrap
@pytest.mark.parametrize("ending", ["the step fails", "the run is cancelled"])
def test_the_step_pre_started_while_its_predecessor_runs_never_runs_if_the_chain_stops(tenant, agent, ending):
    marker = str(uuid.uuid4().int % 10**9)
    first = ["/bin/sh", "-c", f"sleep 3; exit {3 if ending == 'the step fails' else 0}"]
    run = run_submit(tenant=tenant, user=agent, plan=simple_plan(first, ["sleep", f"600.{marker}"])).run
    seen, ran, chain_over = threading.Event(), threading.Event(), threading.Event()

    def meanwhile():
        # The second step's sandbox comes up at its gate while the first one
        # runs; its command must never start, whatever the chain does next.
        cancelled = False
        while not chain_over.is_set():
            if gates_for(marker):
                seen.set()
            if commands_named(marker):
                ran.set()
            if seen.is_set() and ending == "the run is cancelled" and not cancelled:
                Run.objects.filter(pk=run.pk).update(cancel_requested_at=timezone.now(), cancel_requested_by=agent)
                cancelled = True
            chain_over.wait(0.01)

    watcher = threading.Thread(target=meanwhile)
    started = time.time()
    watcher.start()
    try:
        execute_claims(run_advance(run.pk))
        wait_until(lambda: gates_for(marker) == [] and shims_of_the_fork_server() == [], what="the spare gone")
    finally:
        chain_over.set()
        watcher.join()

    assert seen.is_set()
    run.refresh_from_db()
    assert run.state == ("CLOSED_FAILED" if ending == "the step fails" else "CLOSED_CANCELLED")
    second = Step.objects.get(run=run, step_id="s1")
    assert second.status == StepStatus.SKIPPED
    assert not ran.is_set() and commands_named(marker) == []
    # Nor is the task directory its sandbox was preset with left behind.
    assert made_since(started, second) == []


def a_chain_of_two(make_run) -> tuple[Step, Step]:
    """An EXECUTING run's steps a and then b (both `true`), a's attempt
    started, with the fork server up as a worker's earlier steps left it."""
    forkserver.start_server(layout.shim_python(), str(layout.tasks_dir()), 600)
    run = make_run("EXECUTING")
    first, second = Step.objects.bulk_create([
        Step(run=run, step_id="a", position=0, tool="shell", params={"argv": ["true"]}, timeout_s=5),
        Step(run=run, step_id="b", position=1, tool="shell", params={"argv": ["true"]}, timeout_s=5,
             depends_on=["a"]),
    ])
    return start_attempt(first), second


def run_true(step: Step) -> dict:
    return executor.execute(step.handle_id, tool="shell", params={"argv": ["true"]}, timeout_s=5, attempt=1,
                            plan=step.effective_plan)


def test_a_spare_is_closed_when_the_chain_stops_at_a_cancel(tenant, agent, make_run):
    first, second = a_chain_of_two(make_run)
    Run.objects.filter(pk=first.run_id).update(cancel_requested_at=timezone.now(), cancel_requested_by=agent)
    first.run.cancel_requested_at = timezone.now()
    result = run_true(first)

    claim = step_finish(first, 1, result, steps=[first, second])

    assert claim is None
    assert Run.objects.get(pk=first.run_id).state == "CLOSED_CANCELLED"
    assert Step.objects.get(pk=second.pk).status == StepStatus.SKIPPED
    wait_until(lambda: shims_of_the_fork_server() == [], what="the unused spare gone")


def counting_warm_shims(monkeypatch) -> list:
    """Every spare ``runs.settle`` asks for, kept in order (None when none was made)."""
    real, warmed = runs.settle.warm_shim, []

    def warming(*args, **kwargs):
        spare = real(*args, **kwargs)
        warmed.append(spare)
        return spare

    monkeypatch.setattr(runs.settle, "warm_shim", warming)
    return warmed


@needs_bubblewrap
def test_a_first_step_pre_started_but_not_started_here_never_runs(tenant, agent, monkeypatch):
    """The first step's spare is forked before the stages' transaction
    decides; a run that the decision ends instead (a cancel stored before
    its stages ran) closes the spare, and its command never starts."""
    forkserver.start_server(layout.shim_python(), str(layout.tasks_dir()), 600)
    marker = str(uuid.uuid4().int % 10**9)
    run = run_submit(tenant=tenant, user=agent, plan=simple_plan(["sleep", f"600.{marker}"])).run
    Run.objects.filter(pk=run.pk).update(cancel_requested_at=timezone.now(), cancel_requested_by=agent)
    warmed = counting_warm_shims(monkeypatch)

    assert run_advance(run.pk) is None

    assert len(warmed) == 1 and warmed[0] is not None  # the spare was made, then not used
    assert Run.objects.get(pk=run.pk).state == "CLOSED_CANCELLED"
    assert Step.objects.get(run=run).status == StepStatus.SKIPPED
    wait_until(lambda: gates_for(marker) == [] and shims_of_the_fork_server() == [], what="the spare gone")
    assert commands_named(marker) == []


@needs_bubblewrap
def test_the_first_step_s_spare_is_forked_as_soon_as_the_policy_lets_the_run_execute(tenant, agent, monkeypatch):
    """Forked once the policy has rated the steps low, so the sandbox is
    being set up while the rating is bound and the stages dispatch the step
    and commit; the same step with the same plan is then started in it (no
    second spare)."""
    forkserver.start_server(layout.shim_python(), str(layout.tasks_dir()), 600)
    warmed = counting_warm_shims(monkeypatch)
    real_evaluate, real_bind, spares_at = runs.pipeline.evaluate_policy, runs.pipeline.bind_rated_plans, []

    def evaluate(run, steps):
        spares_at.append(("rating", len(warmed)))
        return real_evaluate(run, steps)

    def bind(*args, **kwargs):
        spares_at.append(("binding", len(warmed)))
        return real_bind(*args, **kwargs)

    monkeypatch.setattr(runs.pipeline, "evaluate_policy", evaluate)
    monkeypatch.setattr(runs.pipeline, "bind_rated_plans", bind)
    run = run_submit(tenant=tenant, user=agent, plan=simple_plan(["true"])).run

    execute_claims(run_advance(run.pk))

    assert spares_at == [("rating", 0), ("binding", 1)]
    assert len(warmed) == 1 and warmed[0] is not None
    step = Step.objects.get(run=run)
    assert Run.objects.get(pk=run.pk).state == "SUCCEEDED"
    assert step.result["details"]["started_by"] == "prestart"
    wait_until(lambda: shims_of_the_fork_server() == [], what="every shim and spare gone")


@needs_bubblewrap
def test_a_run_held_for_approval_gets_no_spare_and_leaves_nothing_on_disk(tenant, agent, monkeypatch):
    """A spare is forked only for a run the policy lets execute: one held
    for a human has no shim forked, no sandbox set up and no task directory
    made for it."""
    from policy.models import PolicyRule
    from policy.rules import policy_rule_save

    forkserver.start_server(layout.shim_python(), str(layout.tasks_dir()), 600)
    marker = str(uuid.uuid4().int % 10**9)
    policy_rule_save(PolicyRule(name="test-held-sleep", tool="shell", field="words", pattern=rf"^sleep 600\.{marker}",
                                outcome="high", reason="held in this test", priority=1))
    warmed = counting_warm_shims(monkeypatch)
    started = time.time()
    run = run_submit(tenant=tenant, user=agent, plan=simple_plan(["sleep", f"600.{marker}"])).run

    assert run_advance(run.pk) is None

    assert Run.objects.get(pk=run.pk).state == "AWAITING_HITL"
    assert warmed == []
    assert gates_for(marker) == [] and shims_of_the_fork_server() == []
    assert made_since(started, Step.objects.get(run=run)) == []


@needs_bubblewrap
def test_a_spare_forked_for_another_plan_than_the_rated_one_is_closed_and_replaced(tenant, agent, make_run):
    """``warm_first`` keeps an earlier spare only if the step and the plan
    it was forked for are the ones now forecast."""
    forkserver.start_server(layout.shim_python(), str(layout.tasks_dir()), 600)
    marker = str(uuid.uuid4().int % 10**9)
    run = make_run("EXECUTING")
    step = Step.objects.create(run=run, step_id="a", position=0, tool="shell",
                               params={"argv": ["sleep", f"600.{marker}"]}, timeout_s=5)
    early_spare, early = runs.settle.warm_first([step])
    assert early_spare is not None
    wait_until(lambda: gates_for(marker) != [], what="the early spare's sandbox at its gate")
    other_plan = {**early.plan, "limits": {**(early.plan.get("limits") or {}), "cpu_s": 1}}

    spare, forecast = runs.settle.warm_first([step], (early_spare, replace(early, plan=other_plan)))
    try:
        assert spare is not None and spare is not early_spare
        assert early_spare.sock.fileno() == -1  # closed
        assert forecast.plan == early.plan and forecast.handle_id != early.handle_id
        kept, kept_forecast = runs.settle.warm_first([step], (spare, forecast))
        assert kept is spare and kept_forecast is forecast
    finally:
        spare.close()
    wait_until(lambda: gates_for(marker) == [] and shims_of_the_fork_server() == [], what="both spares gone")
    assert commands_named(marker) == []


@needs_bubblewrap
def test_a_forecast_step_sent_to_the_queue_keeps_the_task_directory_of_its_handle(tenant, agent, make_run,
                                                                                   monkeypatch):
    """The step forecast to follow gets the forecast's handle even when it
    cannot start here (no slot) and goes to the queue: the directory its
    sandbox was preset in is then that attempt's, and stays for its task."""
    first, second = a_chain_of_two(make_run)
    result = run_true(first)
    queued = []
    monkeypatch.setattr(runs.settle, "hand_over_reservation", lambda *args: False)
    monkeypatch.setattr(runs.settle, "reserve_slot", lambda *args: False)
    monkeypatch.setattr(runs.settle, "enqueue_claims", queued.extend)

    assert step_finish(first, 1, result, steps=[first, second]) is None

    second.refresh_from_db()
    assert second.run_status == StepRunStatus.ACCEPTED and [claim.step_pk for claim in queued] == [second.pk]
    assert layout.task_dir(second.handle_id).is_dir()
    wait_until(lambda: shims_of_the_fork_server() == [], what="the unused spare gone")
