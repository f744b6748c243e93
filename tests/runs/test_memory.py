"""Memory write-back only on SUCCEEDED; recall of the same tenant and agent
only, within the context budget (docs/stages.md#memory-write-back,
docs/stages.md#preparing)."""

import pytest
from django.core.management import call_command

from runs.execution import execute_claims
from runs.models import MemoryEntry, Run, Trace
from runs.pipeline import run_advance
from runs.services import run_cancel, run_submit
from runs.transitions import run_transition
from tests.conftest import make_user, simple_plan, token_client

pytestmark = pytest.mark.django_db(transaction=True)


def drive(run_id: int) -> Run:
    execute_claims(run_advance(run_id))
    return Run.objects.get(pk=run_id)


def submit(tenant, user, plan, **extra) -> int:
    return run_submit(tenant=tenant, user=user, plan=plan, **extra).run.pk


def test_hundred_successes_write_hundred_memories_and_failures_none(tenant, agent):
    for index in range(100):
        run = drive(submit(tenant, agent, simple_plan(["echo", f"result-{index}"]), title=f"ok {index}"))
        assert run.state == "SUCCEEDED"
    assert MemoryEntry.objects.count() == 100
    entry = MemoryEntry.objects.get(run__title="ok 7")
    assert (entry.tenant, entry.agent) == (tenant, agent)
    assert entry.data == {"outputs": {"s0": "result-7\n"}}

    for index in range(34):  # failed
        assert drive(submit(tenant, agent, simple_plan(["false"]))).state == "CLOSED_FAILED"
    for index in range(33):  # cancelled before execution
        run_id = submit(tenant, agent, simple_plan(["true"]))
        run_cancel(run=Run.objects.get(pk=run_id), user=agent)
        assert drive(run_id).state == "CLOSED_CANCELLED"
    for index in range(33):  # rejected while awaiting approval
        run_id = submit(tenant, agent, simple_plan(["true"]))
        for target in ("PREPARING", "PLANNING", "POLICY_CHECK", "AWAITING_HITL", "REJECTED"):
            run_transition(run_id, target, caller="test")
        assert drive(run_id).state == "CLOSED_REJECTED"
    assert MemoryEntry.objects.count() == 100
    call_command("execgo_reconcile")


def test_recall_is_same_tenant_same_agent_newest_first(tenant, other_tenant, agent):
    other_agent = make_user("other-agent", tenant)
    outsider = make_user("outsider", other_tenant)
    drive(submit(tenant, agent, simple_plan(["echo", "mine-1"])))
    drive(submit(tenant, agent, simple_plan(["echo", "mine-2"])))
    drive(submit(tenant, other_agent, simple_plan(["echo", "colleague"])))
    drive(submit(other_tenant, outsider, simple_plan(["echo", "foreign"])))

    run = drive(submit(tenant, agent, simple_plan(["true"])))
    recalled = [m["data"]["outputs"]["s0"] for m in run.context["memories"]]
    assert recalled == ["mine-2\n", "mine-1\n"]
    trace = Trace.objects.get(run=run, kind="memory_retrieve")
    assert (trace.data["recalled"], trace.data["kept"], trace.data["dropped"]) == (2, 2, [])


def test_over_budget_drops_oldest_memories_first(tenant, agent, settings):
    for index in range(5):
        drive(submit(tenant, agent, simple_plan(["echo", f"m{index}-" + "x" * 300])))
    settings.EXECGO_CONTEXT_BUDGET_BYTES = 2000
    run = drive(submit(tenant, agent, simple_plan(["true"])))
    assert run.state == "SUCCEEDED"
    kept = [m["data"]["outputs"]["s0"][:2] for m in run.context["memories"]]
    assert kept and kept == ["m4", "m3", "m2", "m1", "m0"][: len(kept)]
    trace = Trace.objects.get(run=run, kind="memory_retrieve")
    assert len(trace.data["dropped"]) == 5 - len(kept) > 0
    assert trace.data["bytes"] <= 2000


def test_still_over_budget_fails_in_preparing(tenant, agent, settings):
    settings.EXECGO_CONTEXT_BUDGET_BYTES = 50
    run = drive(submit(tenant, agent, simple_plan(["true"])))
    assert (run.state, run.closing_cause) == ("CLOSED_FAILED", "failed")
    trace = Trace.objects.get(run=run, kind="memory_retrieve")
    assert trace.error["code"] == "invalid_input"
    assert Trace.objects.filter(run=run, kind="transition", from_state="PREPARING", to_state="FAILED").exists()
    assert not run.steps.exists()


def test_cross_tenant_memory_fails_with_denied(tenant, other_tenant, agent):
    outsider = make_user("outsider", other_tenant)
    foreign_run = drive(submit(other_tenant, outsider, simple_plan(["false"])))
    # A row whose provenance is another tenant's run, filed under this tenant.
    MemoryEntry.objects.create(tenant=tenant, agent=agent, run=foreign_run, summary="leaked", data={"s": "secret"})
    run = drive(submit(tenant, agent, simple_plan(["true"])))
    assert run.state == "CLOSED_FAILED"
    trace = Trace.objects.get(run=run, kind="memory_retrieve")
    assert trace.error["code"] == "denied"
    assert "secret" not in str(run.context)


def test_memories_api_lists_own_memories_only(tenant, other_tenant, agent):
    drive(submit(tenant, agent, simple_plan(["echo", "hello"]), title="greeting"))
    outsider = make_user("outsider", other_tenant)
    drive(submit(other_tenant, outsider, simple_plan(["echo", "x"])))
    mine = token_client(agent).get("/api/v1/memories").json()["results"]
    assert [m["summary"] for m in mine] == ["greeting: 1 step(s) succeeded"]
    theirs = token_client(outsider).get("/api/v1/memories").json()["results"]
    assert [m["data"]["outputs"]["s0"] for m in theirs] == ["x\n"]
