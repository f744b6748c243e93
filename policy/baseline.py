"""The capability baseline of a shell step: the risk it starts from, from
what its effective execution plan lets it reach (docs/policy.md,
"Capability baseline")."""

from collections.abc import Iterable
from typing import Any

from policy.models import RiskLevel
from runs.dataplane import best_plan, rated_part, routed_plan
from runs.models import Step
from runtime.capabilities import capability_manifest
from runtime.envelopes import EnvelopeError

RISK_ORDER = {RiskLevel.LOW: 0, RiskLevel.MEDIUM: 1, RiskLevel.HIGH: 2, RiskLevel.DENY: 3}

CONTAINED_NETWORKS = {
    "none": "no network: only the namespace's own loopback",
    "loopback": "only the namespace's own loopback",
}
NETWORK_REACH = {
    "internet": "a NAT'd network namespace: it cannot reach the host's loopback, but nothing proves it keeps off "
                "the host's other addresses",
    "host": "the host's own network: the database, broker and web on 127.0.0.1 included",
}
# "read_only_host_workspace_rw": an earlier spelling of "workspace" by the resolver.
WORKSPACE_FILESYSTEMS = {"workspace", "read_only_host_workspace_rw"}


def _check(what: str, value: Any, risk: str, reason: str) -> dict:
    return {"check": what, "value": value, "risk": str(risk), "reason": reason}


def plan_baseline(plan: dict, *, worker_is_root: bool) -> dict:
    """The risk a shell step starts from, from what its effective ``plan``
    lets it reach, with the check behind each part of it."""
    profile, network, filesystem = plan.get("profile"), plan.get("network"), plan.get("filesystem")
    checks = [_profile_check(plan)]
    if network in CONTAINED_NETWORKS:
        checks.append(_check("network", network, RiskLevel.LOW, CONTAINED_NETWORKS[network]))
    else:
        checks.append(_check("network", network, RiskLevel.HIGH,
                             NETWORK_REACH.get(network, "a network the policy does not know: assumed to reach all")))
    checks.extend(_filesystem_checks(plan))
    uid = plan.get("uid")
    if uid == 0 or (uid is None and worker_is_root):
        checks.append(_check("uid", uid, RiskLevel.HIGH, "runs as root" if uid == 0 else
                             "runs as the worker's own uid, which is root"))
    else:
        # The value is "own" rather than the number: each step has its own, and the reasons stay the same
        # from a dry run to the policy check.
        checks.append(_check("uid", "own" if uid is not None else "worker", RiskLevel.LOW,
                             "runs as a uid of its own" if uid is not None else
                             "runs as the worker's own (non-root) uid"))
    limits = plan.get("limits") if isinstance(plan.get("limits"), dict) else {}
    if limits.get("processes") is None:
        checks.append(_check("limits.processes", None, RiskLevel.MEDIUM,
                             "no process limit: a fork bomb is stopped only by the step's timeout"))
    else:
        checks.append(_check("limits.processes", limits["processes"], RiskLevel.LOW,
                             f"at most {limits['processes']} processes"))
    for downgrade in plan.get("downgrades") or []:
        checks.append(_check(f"downgrade {downgrade.get('what')}", downgrade.get("effective"), RiskLevel.LOW,
                             f"asked for {downgrade.get('requested')!r}: {downgrade.get('reason')}"))
    risk = max_risk(check["risk"] for check in checks)
    return {"risk": str(risk), "checks": checks,
            "plan": {"profile": profile, "network": network, "filesystem": filesystem,
                     "readonly_paths": plan.get("readonly_paths") or [], "uid": uid,
                     "processes": limits.get("processes"), "downgrades": len(plan.get("downgrades") or [])}}


def _profile_check(plan: dict) -> dict:
    profile = plan.get("profile")
    if profile == "linux_sandbox" and plan.get("seccomp") is False:
        return _check("profile", profile, RiskLevel.MEDIUM,
                      "sandboxed (bubblewrap) without its system call filter: the whole kernel interface "
                      "is open to the command")
    if profile == "linux_sandbox":
        return _check("profile", profile, RiskLevel.LOW, "sandboxed (bubblewrap)")
    if profile == "process" and plan.get("namespaces"):
        return _check("profile", profile, RiskLevel.MEDIUM,
                      "the shim's own mount and network namespaces, nosuid and no_new_privs, but no system "
                      "call filter, the host's user namespace, and the host's root writable wherever its "
                      "uid may write")
    return _check("profile", profile, RiskLevel.HIGH,
                  "not sandboxed: the command runs on the host with only rlimits around it")


def _filesystem_checks(plan: dict) -> list[dict]:
    profile, filesystem = plan.get("profile"), plan.get("filesystem")
    if filesystem in WORKSPACE_FILESYSTEMS and profile == "process":
        return [_check("filesystem", filesystem, RiskLevel.LOW,
                       "the host without the data dir, nosuid,nodev, a workspace of its own")]
    if filesystem in WORKSPACE_FILESYSTEMS:
        checks = [_check("filesystem", filesystem, RiskLevel.LOW,
                         "the host's system directories read-only, only the workspace writable")]
        readonly = plan.get("readonly_paths") or []
        if readonly:
            checks.append(_check("readonly_paths", readonly, RiskLevel.MEDIUM,
                                 "host paths the step can read besides the system directories: "
                                 + ", ".join(readonly)))
        return checks
    reason = ("the host's filesystem, writable wherever its uid may write" if filesystem == "host"
              else "a filesystem view the policy does not know: assumed to be the host's")
    return [_check("filesystem", filesystem, RiskLevel.HIGH, reason)]


def _worker_is_root() -> bool:
    return bool((capability_manifest().get("user") or {}).get("is_root"))


def step_baseline(step: Step) -> dict:
    """The baseline of ``step`` from the plan it will run with: this host's,
    or a stronger one another host gives it (``runs.dataplane.best_plan``)."""
    try:
        plan = best_plan(step)
    except EnvelopeError as exc:
        # A strict sandbox step runs only on hosts that have the sandbox: rate
        # the plan it gets there, not this host's refusal.
        try:
            plan = routed_plan(step)
        except EnvelopeError:
            plan = None
        if plan is None:
            check = _check("plan", None, RiskLevel.HIGH, f"the execution plan cannot be resolved on this host "
                                                         f"({exc.envelope['message']}): what it can reach is unknown")
            return {"risk": str(RiskLevel.HIGH), "checks": [check], "plan": None}
    # The plan rated, for the step to be bound to (taken off by evaluate_policy).
    return {**plan_baseline(plan, worker_is_root=_worker_is_root()), "rated_plan": rated_part(plan)}


def baseline_reasons(baseline: dict) -> list[str]:
    """The checks that set the baseline (and any above low), for the step's reasons."""
    raised = [check for check in baseline["checks"] if check["risk"] != RiskLevel.LOW]
    if raised:
        return [f"baseline {check['risk']}: {check['check']} {check['value']} - {check['reason']}"
                for check in raised]
    return ["baseline low: " + ", ".join(f"{check['check']} {check['value']}" for check in baseline["checks"])]


def max_risk(risks: Iterable[str]) -> str:
    return max(risks, key=RISK_ORDER.__getitem__, default=RiskLevel.LOW)

