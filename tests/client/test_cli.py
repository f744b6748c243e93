"""The ``execgo`` command line as a user runs it: a separate process (no
Django) against the live server and a real worker."""

import json
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, make_token, make_user, simple_plan, wait_for_run

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("echo_pip_install_is_high")]

FAILING_PLAN = {"steps": [{"id": "x", "tool": "shell", "params": {"script": "exit 3"}}]}
DENIED_PLAN = simple_plan(["sudo", "true"])
HIGH_RISK_PLAN = simple_plan(["echo", "pip", "install", "x"])


def execgo(env: dict, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "execgo_client.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def server(seeded_policy, live_web, celery_worker, client_env):
    return client_env


@pytest.fixture
def write_plan(tmp_path):
    def write(plan: dict, name: str = "plan.json") -> str:
        path = tmp_path / name
        path.write_text(json.dumps(plan))
        return str(path)

    return write


def run_id_of(result: subprocess.CompletedProcess) -> int:
    return json.loads(result.stdout)["id"]


def test_submit_wait_succeeds_and_json_parses(server, write_plan):
    plan = write_plan(simple_plan(["echo", "hello"], ["sh", "-c", "echo $((40 + 2))"]))
    result = execgo(server, "submit", plan, "--wait", "--title", "cli hello")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCEEDED" in result.stdout
    assert "2/2 done" in result.stdout and "42" in result.stdout

    result = execgo(server, "submit", plan, "--wait", "--json")
    assert result.returncode == 0, result.stderr
    run = json.loads(result.stdout)
    assert run["state"] == "SUCCEEDED" and run["allowed_actions"]["retry"] is not None

    result = execgo(server, "--json", "status", str(run["id"]))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["id"] == run["id"]
    result = execgo(server, "status", str(run["id"]))
    assert result.returncode == 0 and "SUCCEEDED (succeeded)" in result.stdout


def test_a_failing_step_exits_2_with_its_error_envelope(server, write_plan):
    result = execgo(server, "submit", write_plan(FAILING_PLAN), "--wait")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "CLOSED_FAILED" in result.stdout
    envelope = json.loads(result.stderr.splitlines()[0])
    assert envelope["step"] == "x"
    assert envelope["error"]["code"] == "external_failure"
    assert "exited with code 3" in envelope["error"]["message"]

    # retry makes a new run of the same plan: it fails the same way
    run_id = int(result.stdout.split()[1])
    result = execgo(server, "retry", str(run_id), "--wait", "--json")
    assert result.returncode == 2, result.stderr
    assert json.loads(result.stdout)["retry_of"] == run_id

    # without --wait, the new run is named as it was submitted
    result = execgo(server, "retry", str(run_id))
    assert result.returncode == 0, result.stderr
    named = re.fullmatch(rf"run (\d+) submitted \(retry of {run_id}\): CREATED\n", result.stdout)
    assert named, result.stdout
    assert wait_for_run(int(named[1])).state == "CLOSED_FAILED"  # nothing of it left running after the test


def test_a_denied_plan_exits_3_and_evaluate_says_deny(server, write_plan):
    plan = write_plan(DENIED_PLAN)
    result = execgo(server, "submit", plan, "--wait")
    assert result.returncode == 3, result.stdout + result.stderr
    assert "CLOSED_REJECTED" in result.stdout
    result = execgo(server, "submit", plan)  # without --wait: named as it was submitted
    assert result.returncode == 0, result.stderr
    named = re.fullmatch(r"run (\d+) submitted: CREATED\n", result.stdout)
    assert named, result.stdout
    assert wait_for_run(int(named[1])).state == "CLOSED_REJECTED"  # nothing of it left running after the test

    result = execgo(server, "evaluate", plan)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[:2] == ["risk", "deny"]
    assert "rejected" in result.stdout and "sudo" in result.stdout
    result = execgo(server, "evaluate", plan, "--json")
    evaluation = json.loads(result.stdout)
    assert (evaluation["risk"], evaluation["rejected"]) == ("deny", True)

    result = execgo(server, "evaluate", write_plan({"steps": "no"}, "bad.json"))
    assert result.returncode == 1
    assert json.loads(result.stderr)["error"]["code"] == "invalid_input"


def test_a_high_risk_run_exits_5_with_the_approval_page_then_cancel(server, write_plan, live_web):
    result = execgo(server, "submit", write_plan(HIGH_RISK_PLAN), "--wait")
    assert result.returncode == 5, result.stdout + result.stderr
    assert "AWAITING_HITL" in result.stdout
    assert f"awaiting human approval: {live_web.url}/approvals/" in result.stdout
    run_id = int(result.stdout.split()[1])

    result = execgo(server, "--json", "status", str(run_id))
    assert result.returncode == 5
    assert json.loads(result.stdout)["allowed_actions"]["approval"]["page"].startswith("/approvals/")

    result = execgo(server, "cancel", str(run_id), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["id"] == run_id

    # watch follows it to its end and exits by its final state
    result = execgo(server, "watch", str(run_id), timeout=60)
    assert result.returncode == 4, result.stdout + result.stderr
    assert "AWAITING_HITL" in result.stdout and "CLOSED_CANCELLED" in result.stdout

    result = execgo(server, "cancel", str(run_id))
    assert result.returncode == 1
    assert json.loads(result.stderr)["error"]["code"] == "invalid_input"  # 409: the run is final


def test_watch_shows_state_changes_progress_and_step_output(server, write_plan):
    plan = {"steps": [
        {"id": "work", "tool": "shell", "params": {"script": "echo '::progress 50 half way'; sleep 0.3; echo done"}},
        {"id": "after", "tool": "shell", "params": {"argv": ["true"]}, "depends_on": ["work"]},
    ]}
    result = execgo(server, "submit", write_plan(plan), "--json")
    assert result.returncode == 0, result.stderr
    run_id = run_id_of(result)

    result = execgo(server, "watch", str(run_id), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "[0/2 steps] EXECUTING" in lines
    assert "  work: 50% half way" in lines
    assert "[1/2 steps] EXECUTING" in lines
    assert any(line.startswith("[2/2 steps] SUCCEEDED") for line in lines)
    assert lines.index("[0/2 steps] EXECUTING") < lines.index("  work: 50% half way") < lines.index(
        "[1/2 steps] EXECUTING")

    result = execgo(server, "watch", str(run_id), "--json", timeout=60)
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert events[-1]["type"] == "run_state_changed" and events[-1]["data"]["to"] == "SUCCEEDED"
    assert [event["id"] for event in events] == sorted(event["id"] for event in events)


def test_approvals_need_an_approver_and_errors_are_envelopes(server, tenant, write_plan):
    result = execgo(server, "approvals")
    assert result.returncode == 1
    assert json.loads(result.stderr)["error"]["code"] == "denied"  # an agent's token

    result = execgo(server, "submit", write_plan(HIGH_RISK_PLAN), "--wait", "--json")
    assert result.returncode == 5
    run_id = run_id_of(result)
    approver = make_user("alice", tenant, groups=("approvers",))
    env = {**server, "EXECGO_TOKEN": make_token(approver)}
    result = execgo(env, "approvals", "--json")
    assert result.returncode == 0, result.stderr
    assert [item["run_id"] for item in json.loads(result.stdout)] == [run_id]
    result = execgo(env, "approvals")
    assert result.returncode == 0 and "/approvals/" in result.stdout and "pending" in result.stdout

    result = execgo(server, "status", "999999")
    assert result.returncode == 1
    assert json.loads(result.stderr)["error"]["code"] == "not_found"
    result = execgo({**server, "EXECGO_TOKEN": "wrong"}, "status", "1")
    assert result.returncode == 1
    assert json.loads(result.stderr)["error"]["code"] == "denied"
    result = execgo(server, "submit", "/nonexistent/plan.json")
    assert result.returncode == 1
    assert json.loads(result.stderr)["error"]["code"] == "invalid_input"
