"""What the other apps ask of the policy: the kernel rates a run's plan at
POLICY_CHECK (``evaluate_policy``) and a plan that is not a run
(``policy_dry_run``); approvals rate an edited plan and check the version a
request was opened under; the API replays a rule change over stored plans
(``policy_replay``). Nothing else of the policy is theirs to import
(pyproject.toml's import contracts hold them to this)."""

from policy.baseline import RISK_ORDER
from policy.evaluation import PolicyDecision, evaluate_policy, policy_dry_run
from policy.replay import DEFAULT_RUNS, MAX_RUNS, ReplayReport, RuleChange, policy_replay, rule_from
from policy.rules import current_policy_version

__all__ = ["DEFAULT_RUNS", "MAX_RUNS", "RISK_ORDER", "PolicyDecision", "ReplayReport", "RuleChange",
           "current_policy_version", "evaluate_policy", "policy_dry_run", "policy_replay", "rule_from"]
