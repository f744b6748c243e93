"""A shell step's risk starts from its effective execution plan
(docs/policy.md#capability-baseline): the capability baseline, from
hand-built plans and through the real resolver, and how it shows in the
decision trace, the dry-run API and the run page."""

import pytest
from django.test import Client
from django.utils.html import escape

from approvals.models import ApprovalRequest
from policy.baseline import baseline_reasons, plan_baseline, step_baseline
from policy.interface import policy_dry_run
from runs.models import Step
from runs.pipeline import run_advance
from runs.services import run_submit
from runtime.capabilities import capability_manifest
from tests.conftest import make_user
from tests.policy.policy_steps import SANDBOXED

LIMITS = {"cpu_seconds": None, "address_space_bytes": None, "file_size_bytes": None, "open_files": 1024,
          "processes": 64, "workspace_bytes": None, "log_cap_bytes": 8 << 20}
CONTAINED = {"profile": "linux_sandbox", "network": "none", "filesystem": "workspace", "uid": 65534,
             "limits": LIMITS, "downgrades": []}


def plan(**changes) -> dict:
    return {**CONTAINED, **changes}


def raised(baseline: dict) -> dict[str, str]:
    return {check["check"]: check["risk"] for check in baseline["checks"] if check["risk"] != "low"}


# --- hand-built plans --------------------------------------------------------------


@pytest.mark.parametrize("network", ["none", "loopback"])
def test_a_contained_plan_starts_low(network):
    baseline = plan_baseline(plan(network=network), worker_is_root=True)

    assert baseline["risk"] == "low"
    assert raised(baseline) == {}
    assert baseline_reasons(baseline) == [
        f"baseline low: profile linux_sandbox, network {network}, filesystem workspace, uid own, "
        "limits.processes 64"]


@pytest.mark.parametrize(("changes", "worker_is_root", "risk", "checks"), [
    ({"network": "internet"}, False, "high", {"network": "high"}),
    ({"network": "host"}, False, "high", {"network": "high"}),
    ({"network": "bridge"}, False, "high", {"network": "high"}),  # unknown: assumed to reach everything
    ({"filesystem": "host"}, False, "high", {"filesystem": "high"}),
    ({"filesystem": None}, False, "high", {"filesystem": "high"}),
    ({"uid": None}, True, "high", {"uid": "high"}),  # the worker's own uid, and it is root
    ({"uid": 0}, False, "high", {"uid": "high"}),
    ({"limits": {**LIMITS, "processes": None}}, False, "medium", {"limits.processes": "medium"}),
    ({"limits": None}, False, "medium", {"limits.processes": "medium"}),
    ({"profile": "process", "network": "host", "filesystem": "host", "uid": None,
      "limits": {**LIMITS, "processes": None}}, True, "high",
     {"profile": "high", "network": "high", "filesystem": "high", "uid": "high", "limits.processes": "medium"}),
])
def test_reach_beyond_the_workspace_raises_the_baseline(changes, worker_is_root, risk, checks):
    baseline = plan_baseline(plan(**changes), worker_is_root=worker_is_root)

    assert baseline["risk"] == risk
    assert raised(baseline) == checks
    assert all(reason.startswith(f"baseline {checks[reason.split()[2]]}: ")
               for reason in baseline_reasons(baseline))


def test_internet_needs_a_human_and_says_why():
    baseline = plan_baseline(plan(network="internet"), worker_is_root=False)

    assert baseline_reasons(baseline) == [
        "baseline high: network internet - a NAT'd network namespace: it cannot reach the host's loopback, but "
        "nothing proves it keeps off the host's other addresses"]


def test_the_workers_own_uid_is_fine_when_the_worker_is_not_root():
    assert plan_baseline(plan(uid=None), worker_is_root=False)["risk"] == "low"


def test_downgrades_are_listed_and_the_resulting_plan_is_what_is_rated():
    downgraded = plan(profile="process", network="host", filesystem="host",
                      downgrades=[{"what": "profile", "requested": "linux_sandbox", "effective": "process",
                                   "reason": "bubblewrap unusable on this host: not found"}])
    baseline = plan_baseline(downgraded, worker_is_root=False)

    assert baseline["risk"] == "high"
    assert {"check": "downgrade profile", "value": "process", "risk": "low",
            "reason": "asked for 'linux_sandbox': bubblewrap unusable on this host: not found"} in baseline["checks"]
    assert baseline["plan"]["downgrades"] == 1


# --- through the real resolver -------------------------------------------------------------


@pytest.fixture
def no_namespaces(monkeypatch):
    """A host whose worker cannot create namespaces (not root, or a container
    without CAP_SYS_ADMIN): the process profile then reaches the host."""
    real = capability_manifest()
    monkeypatch.setattr("runtime.plan_resolver.capability_manifest",
                        lambda: {**real, "namespaces": {"mount": False, "net": False}})


@pytest.mark.django_db
def test_the_real_resolver_rates_an_unsandboxed_step_high_and_a_sandboxed_one_low(seeded_policy, tenant,
                                                                                  no_namespaces):
    decision = policy_dry_run(tenant=tenant, plan={"steps": [
        {"id": "s0", "tool": "shell", "params": {"argv": ["echo", "hi"]}, "sandbox": {"profile": "process"}},
        {"id": "s1", "tool": "shell", "params": {"argv": ["echo", "hi"]}, "sandbox": SANDBOXED},
    ]})
    on_host, contained = decision.data["steps"]

    assert on_host["risk"] == "high" and on_host["baseline"]["risk"] == "high"
    assert on_host["baseline"]["plan"]["network"] == "host" and on_host["baseline"]["plan"]["filesystem"] == "host"
    assert "baseline high: network host - the host's own network: the database, broker and web on 127.0.0.1 " \
           "included" in on_host["reasons"]
    assert decision.risk == "high"  # needs a human
    assert decision.data["matched_rules"] == []  # the baseline is not a rule: no quorum comes from it
    if not (capability_manifest().get("bubblewrap") or {}).get("available"):
        # adaptive mode downgrades to process: the same reach as on_host
        assert contained["risk"] == "high"
        return
    assert contained["risk"] == "low"
    assert contained["baseline"]["plan"]["profile"] == "linux_sandbox"


@pytest.mark.django_db
def test_a_plan_the_resolver_refuses_is_high():
    # Submission validates limits; a stored step can still carry one the resolver refuses.
    step = Step(step_id="s0", tool="shell", params={"argv": ["true"]}, requested_plan={"limits": {"processes": 0}})

    baseline = step_baseline(step)

    assert baseline["risk"] == "high" and baseline["plan"] is None
    assert [check["check"] for check in baseline["checks"]] == ["plan"]
    assert baseline["checks"][0]["reason"] == (
        "the execution plan cannot be resolved on this host (limit processes=0 is outside [1, 4194304]): "
        "what it can reach is unknown")


# --- where the baseline shows ------------------------------------------------------------------


@pytest.mark.django_db
def test_the_dry_run_api_shows_the_baseline_and_the_signals(api, seeded_policy, no_namespaces):
    plan = {"steps": [
        {"id": "s0", "tool": "shell", "params": {"script": "P=echo; $P hi"}, "sandbox": SANDBOXED},
        {"id": "s1", "tool": "shell", "params": {"argv": ["echo", "hi"]}, "sandbox": {"profile": "process"}},
    ]}
    response = api.post("/api/v1/policy/evaluate", {"plan": plan}, format="json")

    assert response.status_code == 200, response.content
    body = response.json()
    first, second = body["steps"]
    assert first["parsed"]["signals"] == [
        {"signal": "unresolvable", "risk": "medium",
         "detail": "the command word is a variable or a substitution ($P)"}]
    assert "unresolvable: the command word is a variable or a substitution ($P)" in first["reasons"]
    assert second["risk"] == "high" and second["baseline"]["plan"]["network"] == "host"
    assert (body["risk"], body["needs_human"], body["rejected"]) == ("high", True, False)


@pytest.mark.django_db
def test_the_dry_run_of_a_plan_over_the_budget_is_still_rated(seeded_policy, tenant, settings):
    settings.EXECGO_BUDGET_MAX_STEPS = 1
    plan = {"steps": [{"id": f"s{index}", "tool": "shell", "params": {"argv": ["true"]}, "sandbox": SANDBOXED}
                      for index in range(2)]}

    decision = policy_dry_run(plan=plan, tenant=tenant)

    assert decision.risk == "deny" and decision.data["rejected_by"] == "budget"
    assert all("baseline" in row for row in decision.data["steps"])


@pytest.mark.django_db(transaction=True)
def test_a_step_with_host_reach_waits_for_a_human_and_the_pages_say_why(seeded_policy, tenant, agent, settings,
                                                                        no_namespaces):
    # Driven in this thread (the advance task runs inline at commit); the
    # run stops in AWAITING_HITL, so nothing executes.
    settings.CELERY_TASK_ALWAYS_EAGER = True
    settings.CELERY_TASK_EAGER_PROPAGATES = True
    plan = {"steps": [{"id": "s0", "tool": "shell", "params": {"argv": ["echo", "hi"]},
                       "sandbox": {"profile": "process"}}]}
    run = run_submit(tenant=tenant, user=agent, plan=plan).run
    run_advance(run.pk)
    run.refresh_from_db()

    assert run.state == "AWAITING_HITL"
    reason = ("baseline high: filesystem host - the host's filesystem, writable wherever its uid may write")
    request = ApprovalRequest.objects.get(run=run)
    assert reason in request.steps[0]["reasons"] and request.steps[0]["risk"] == "high"
    assert request.approvals_required == 1  # a baseline is not a rule: no quorum of its own
    approver = make_user("approver", tenant, groups=("approvers",))
    client = Client()
    client.force_login(approver)
    for url in (f"/runs/{run.pk}/", f"/approvals/{request.pk}/"):
        response = client.get(url)
        assert response.status_code == 200
        assert escape(reason) in response.content.decode(), url


@pytest.mark.django_db
def test_a_strict_sandbox_step_rated_on_a_host_without_bubblewrap_is_rated_as_where_it_runs(
        seeded_policy, tenant, monkeypatch):
    # The policy check may run on any worker; a strict linux_sandbox step runs only where bubblewrap works.
    real = capability_manifest()
    monkeypatch.setattr("runtime.plan_resolver.capability_manifest",
                        lambda: {**real, "bubblewrap": {"available": False, "error": "bwrap not installed"}})
    decision = policy_dry_run(tenant=tenant, plan={"steps": [
        {"id": "s0", "tool": "shell", "params": {"argv": ["echo", "hi"]},
         "sandbox": {"profile": "linux_sandbox", "mode": "strict"}}]})

    step = decision.data["steps"][0]
    assert (step["risk"], step["baseline"]["plan"]["profile"]) == ("low", "linux_sandbox")
