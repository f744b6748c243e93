"""docs/state-machine.md#what-each-failure-becomes end to end on a real
worker: every cause of failure reaches its transient state, its final state,
its key trace and its audit event. Also the approval path that resumes
execution."""

import json
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from approvals.models import APPROVERS_GROUP
from approvals.services import approval_decide
from runs.errors import ExecGoError
from runs.models import AuditLog, MemoryEntry, Run
from runs.services import run_cancel, run_submit
from runs.sweeper import sweep_run
from tests.conftest import WorkerProcess, make_user, purge_broker, simple_plan, wait_for_run

pytestmark = pytest.mark.django_db(transaction=True)

VALID_PLAN = {"steps": [{"id": "hello", "tool": "shell", "params": {"argv": ["echo", "planned"]}}]}


class PlannerHandler(BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint whose answer depends on the goal."""

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        goal = body["messages"][-1]["content"]
        if "slow" in goal:
            time.sleep(3)
        content = "this is not json at all" if "garbage" in goal else json.dumps(VALID_PLAN)
        payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the planner gave up waiting: that is the point of the slow answer

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def planner_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), PlannerHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


@pytest.fixture(scope="module")
def matrix_worker(django_db_setup, django_db_blocker, planner_url):
    """A worker of its own, configured with the test planner endpoint."""
    with django_db_blocker.unblock():
        purge_broker()
        worker = WorkerProcess(hostname="matrix", env={
            "EXECGO_LLM_URL": planner_url, "EXECGO_LLM_TIMEOUT_S": "1", "EXECGO_LLM_RETRIES": "0",
        }).start()
    yield worker
    worker.stop()


@pytest.fixture
def approver(tenant):
    return make_user("approver", tenant, groups=(APPROVERS_GROUP,))


def run_decide(*, run: Run, approve: bool, actor, comment: str = "") -> Run:
    """Decide the run's pending approval request through the one decision service."""
    request = run.approval_requests.get(status="pending")
    approval_decide(request=request, actor=actor, approve=approve, digest=request.action_digest, comment=comment)
    return Run.objects.get(pk=run.pk)


def submit(tenant, agent, **request) -> int:
    return run_submit(tenant=tenant, user=agent, **request).run.pk


def path(run: Run) -> list[str]:
    return list(run.traces.filter(kind="transition").values_list("to_state", flat=True))


def assert_closed(run: Run, *, transient: str, final: str, trace_kind: str, audit_event: str):
    assert run.state == final, path(run)
    states = path(run)
    assert states[-3:] == [transient, "TRACING", final]
    assert run.traces.filter(kind=trace_kind).exists(), list(run.traces.values_list("kind", flat=True))
    assert AuditLog.objects.filter(run=run, event=audit_event).count() == 1
    assert not MemoryEntry.objects.filter(run=run).exists()
    return run.traces.filter(kind=trace_kind).last()


def test_cross_tenant_memory_fails_in_preparing(matrix_worker, tenant, other_tenant, agent):
    outsider = make_user("outsider", other_tenant)
    foreign = Run.objects.get(pk=submit(other_tenant, outsider, plan=simple_plan(["false"])))
    wait_for_run(foreign.pk)
    MemoryEntry.objects.create(tenant=tenant, agent=agent, run=foreign, summary="not yours")
    run = wait_for_run(submit(tenant, agent, plan=simple_plan(["true"])))
    trace = assert_closed(run, transient="FAILED", final="CLOSED_FAILED", trace_kind="memory_retrieve",
                          audit_event="run_failed")
    assert trace.error["code"] == "denied"


def test_unparsable_plan_fails_in_planning(matrix_worker, tenant, agent):
    run = wait_for_run(submit(tenant, agent, planner="llm", goal="answer with garbage"))
    trace = run.traces.get(kind="tool_invocation", to_state="FAILED")
    assert trace.data["tool"] == "planner" and trace.error["code"] == "external_failure"
    assert_closed(run, transient="FAILED", final="CLOSED_FAILED", trace_kind="tool_invocation",
                  audit_event="run_failed")


def test_planner_timeout_closes_failed(matrix_worker, tenant, agent):
    run = wait_for_run(submit(tenant, agent, planner="llm", goal="be slow"))
    trace = run.traces.get(kind="tool_invocation", to_state="TIMEOUT")
    assert trace.error["code"] == "timeout"
    assert run.closing_cause == "planning_timeout"
    assert_closed(run, transient="TIMEOUT", final="CLOSED_FAILED", trace_kind="tool_invocation",
                  audit_event="run_failed")


def test_valid_llm_plan_succeeds(matrix_worker, tenant, agent):
    run = wait_for_run(submit(tenant, agent, planner="llm", goal="say hello"))
    assert run.state == "SUCCEEDED"
    assert run.steps.get().result["output"]["stdout"] == "planned\n"


def test_policy_denial_closes_rejected(matrix_worker, seeded_policy, tenant, agent):
    run = wait_for_run(submit(tenant, agent, plan=simple_plan(["sudo", "true"])))
    trace = assert_closed(run, transient="REJECTED", final="CLOSED_REJECTED", trace_kind="policy_decision",
                          audit_event="run_rejected")
    assert trace.data["rejected_by"] == "rule"
    assert [rule["rule"] for rule in trace.data["matched_rules"]] == ["shell-sudo"]
    assert not run.steps.filter(status="success").exists()


def test_approver_rejection_closes_rejected(matrix_worker, seeded_policy, tenant, agent, approver):
    run_id = submit(tenant, agent, plan=simple_plan(["pip", "install", "requests"]))
    run = wait_for_run(run_id, states={"AWAITING_HITL"})
    assert run.context["policy"]["risk"] == "high"
    run = run_decide(run=run, approve=False, actor=approver, comment="not on this host")
    trace = assert_closed(run, transient="REJECTED", final="CLOSED_REJECTED", trace_kind="hitl_decision",
                          audit_event="run_rejected")
    assert trace.data["decision"] == "reject" and trace.data["approver"] == approver.pk
    assert AuditLog.objects.get(run=run, event="approval_rejected").actor == approver


def test_expired_approval_closes_rejected(matrix_worker, seeded_policy, tenant, agent):
    run_id = submit(tenant, agent, plan=simple_plan(["apt-get", "install", "-y", "jq"]), approval_timeout_s=60)
    run = wait_for_run(run_id, states={"AWAITING_HITL"})
    assert sweep_run(run, age=timedelta(seconds=61)) is True
    run.refresh_from_db()
    trace = assert_closed(run, transient="TIMEOUT", final="CLOSED_REJECTED", trace_kind="hitl_decision",
                          audit_event="run_rejected")
    assert trace.data["timeout"] is True and trace.data["decision"] == "reject"
    assert run.closing_cause == "approval_timeout"


def test_approval_resumes_execution(matrix_worker, seeded_policy, echo_pip_install_is_high, tenant, agent, approver):
    plan = {"steps": [
        {"id": "prep", "tool": "shell", "params": {"argv": ["echo", "ready"]}},
        {"id": "install", "tool": "shell", "params": {"script": "echo pip install --dry-run nothing"},
         "depends_on": ["prep"]},
    ]}
    run = wait_for_run(submit(tenant, agent, plan=plan), states={"AWAITING_HITL"})
    with pytest.raises(ExecGoError) as self_approval:  # separation of duties
        run_decide(run=run, approve=True, actor=agent)
    assert self_approval.value.envelope["code"] == "denied"
    run_decide(run=run, approve=True, actor=approver)
    run = wait_for_run(run.pk)
    assert run.state == "SUCCEEDED"
    assert path(run)[-4:] == ["AWAITING_HITL", "EXECUTING", "TRACING", "SUCCEEDED"]
    assert AuditLog.objects.get(run=run, event="approval_approved").actor == approver
    # The closing trace sums the run up, naming its policy and human decisions (jsonb keeps no key order).
    summary = run.traces.get(kind="run", to_state="SUCCEEDED").data
    ids = {kind: list(run.traces.filter(kind=kind).values_list("id", flat=True))
           for kind in ("policy_decision", "hitl_decision")}
    assert ids["policy_decision"] and ids["hitl_decision"]
    assert (summary["policy_traces"], summary["hitl_traces"]) == (ids["policy_decision"], ids["hitl_decision"])
    assert sorted(summary["stage_ms"]) == sorted(path(run)[:-2]) and all(ms >= 0 for ms in summary["stage_ms"].values())
    assert summary["steps"] == [{"step_id": "prep", "status": "success", "attempt": 1},
                                {"step_id": "install", "status": "success", "attempt": 1}]
    assert (summary["attempts"], summary["closing_cause"]) == (2, "succeeded")


def test_tool_failure_after_retries_closes_failed(matrix_worker, tenant, agent):
    plan = {"steps": [{"id": "flaky", "tool": "shell", "params": {"script": "exit 2"}, "retries": 1}]}
    run = wait_for_run(submit(tenant, agent, plan=plan))
    trace = assert_closed(run, transient="FAILED", final="CLOSED_FAILED", trace_kind="tool_invocation",
                          audit_event="run_failed")
    assert trace.data["retry_count"] == 1 and trace.error["code"] == "external_failure"


def test_run_timeout_closes_failed(matrix_worker, tenant, agent):
    run = wait_for_run(submit(tenant, agent, plan=simple_plan(["sleep", "30"]), timeout_s=2))
    trace = assert_closed(run, transient="TIMEOUT", final="CLOSED_FAILED", trace_kind="run",
                          audit_event="run_failed")
    assert run.closing_cause == "run_timeout"
    assert run.traces.get(kind="run", to_state="TIMEOUT").data["layer"] == "harness"
    assert trace.to_state == "CLOSED_FAILED"


def test_user_stop_closes_cancelled(matrix_worker, tenant, agent):
    run_id = submit(tenant, agent, plan=simple_plan(["sleep", "30"]))
    run = wait_for_run(run_id, states={"EXECUTING"})
    run_cancel(run=run, user=agent)
    run = wait_for_run(run_id, timeout=20)
    assert_closed(run, transient="CANCELLED", final="CLOSED_CANCELLED", trace_kind="run",
                  audit_event="run_cancelled")
    assert AuditLog.objects.get(run=run, event="run_cancelled").actor == agent
