"""Fixtures shared by the approvals' tests: the approvers and the pending
request of the interface tests (test_interfaces_*.py), and the approvers and
the run driven up to AWAITING_HITL of the decision service's tests
(test_decisions*.py)."""

import pytest

from approvals.models import APPROVERS_GROUP
from runs.models import Run
from runs.pipeline import run_advance
from runs.services import run_submit
from tests.approvals.decisions_helpers import APPROVAL_TIMEOUT_S, PLAN, path_of
from tests.approvals.interfaces_helpers import waiting_run
from tests.conftest import make_user, open_approval

# --- the interface tests (test_interfaces_*.py) ----------------------------------


@pytest.fixture
def alice(tenant):
    return make_user("alice", tenant, groups=("approvers",))


@pytest.fixture
def bob(tenant):
    return make_user("bob", tenant, groups=("approvers",))


@pytest.fixture
def outsider(other_tenant):
    """An approver, of the other tenant."""
    return make_user("globex-approver", other_tenant, groups=("approvers",))


@pytest.fixture
def pending(make_run):
    return open_approval(waiting_run(make_run))


# --- the decision service's tests (test_decisions*.py) ---------------------------


@pytest.fixture
def approver(tenant):
    return make_user("approver", tenant, groups=(APPROVERS_GROUP,))


@pytest.fixture
def second_approver(tenant):
    return make_user("approver-2", tenant, groups=(APPROVERS_GROUP,))


@pytest.fixture
def awaiting(seeded_policy, tenant, agent):
    """A run submitted and driven in this thread by the real pipeline (seeded
    policy) up to AWAITING_HITL. The advance and expiry tasks are registered
    on commit of the test's transaction, which never commits: nothing is sent."""

    def factory(*, user=None, plan=PLAN) -> Run:
        run = run_submit(tenant=tenant, user=user or agent, plan=plan, approval_timeout_s=APPROVAL_TIMEOUT_S).run
        assert run_advance(run.pk) is None  # stops at AWAITING_HITL, waiting for a human
        run.refresh_from_db()
        assert run.state == "AWAITING_HITL", path_of(run)
        return run

    return factory
