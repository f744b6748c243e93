"""Random sequences of everything that can happen to a few runs, checked
after every step against a model of docs/state-machine.md and
docs/sweeper.md and against the reconciliation invariants."""

from dataclasses import dataclass
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from runs.audit import erase_audit_log
from runs.closing import run_close
from runs.errors import ConflictError
from runs.invariants import find_violations
from runs.models import AuditLog, Event, Job, Run, Trace
from runs.services import run_cancel, run_retry
from runs.statemachine import ZOMBIE_SWEEPER
from runs.sweeper import sweep_run
from runs.transitions import InvalidTransitionError, run_transition

STATES = (
    "CREATED", "PREPARING", "PLANNING", "POLICY_CHECK", "AWAITING_HITL", "EXECUTING", "TRACING",
    "REJECTED", "FAILED", "TIMEOUT", "CANCELLED",
    "SUCCEEDED", "CLOSED_REJECTED", "CLOSED_FAILED", "CLOSED_CANCELLED",
)
TRANSIENT = ("REJECTED", "FAILED", "TIMEOUT", "CANCELLED")
FINAL = ("SUCCEEDED", "CLOSED_REJECTED", "CLOSED_FAILED", "CLOSED_CANCELLED")

# docs/state-machine.md#legal-transitions (without the sweeper-only rows).
EXPECTED_EDGES = {
    "CREATED": {"PREPARING"},
    "PREPARING": {"PLANNING", "FAILED"},
    "PLANNING": {"POLICY_CHECK", "FAILED", "TIMEOUT"},
    "POLICY_CHECK": {"EXECUTING", "AWAITING_HITL", "REJECTED"},
    "AWAITING_HITL": {"EXECUTING", "REJECTED", "TIMEOUT", "CANCELLED"},
    "EXECUTING": {"TRACING", "FAILED", "TIMEOUT", "CANCELLED"},
    "REJECTED": {"TRACING"}, "FAILED": {"TRACING"}, "TIMEOUT": {"TRACING"}, "CANCELLED": {"TRACING"},
    "TRACING": set(FINAL),  # each only with the matching closing cause
}
NEXT_ON_MAIN_PATH = {
    "CREATED": "PREPARING", "PREPARING": "PLANNING", "PLANNING": "POLICY_CHECK", "POLICY_CHECK": "EXECUTING",
    "EXECUTING": "TRACING",
}
TIMEOUT_CAUSE = {"AWAITING_HITL": "approval_timeout", "PLANNING": "planning_timeout", "EXECUTING": "run_timeout"}
FINAL_FOR_CAUSE = {
    "succeeded": "SUCCEEDED", "rejected": "CLOSED_REJECTED", "approval_timeout": "CLOSED_REJECTED",
    "failed": "CLOSED_FAILED", "planning_timeout": "CLOSED_FAILED", "run_timeout": "CLOSED_FAILED",
    "cancelled": "CLOSED_CANCELLED",
}
# The edge the sweeper forces out of each non-transient state
# (docs/sweeper.md#thresholds-and-forced-paths).
SWEEPER_EDGE = {
    "CREATED": "FAILED", "PREPARING": "FAILED", "PLANNING": "TIMEOUT", "POLICY_CHECK": "FAILED",
    "AWAITING_HITL": "TIMEOUT", "EXECUTING": "TIMEOUT", "TRACING": "FAILED",
}
# docs/state-machine.md#job-status-projection.
JOB_STATUS = {
    **dict.fromkeys(("CREATED", "PREPARING", "PLANNING", "POLICY_CHECK"), "pending"),
    **dict.fromkeys(("AWAITING_HITL", "EXECUTING", "TRACING", *TRANSIENT), "running"),
    "SUCCEEDED": "done",
    **dict.fromkeys(("CLOSED_REJECTED", "CLOSED_FAILED", "CLOSED_CANCELLED"), "failed"),
}
MAX_RUNS = 5
# Where an initial run starts, reached along real edges so its history is
# genuine; without a head start the always-enabled rules (sweep, cancel,
# close) end most runs before they get deep into the main path.
HEAD_START = ("CREATED", "PREPARING", "PLANNING", "POLICY_CHECK", "EXECUTING", "TRACING")


@dataclass
class Expected:
    """What the model says one run looks like."""

    state: str = "CREATED"
    previous: str = ""
    cause: str = ""
    cancel_requested: bool = False
    cancels_superseded: int = 0
    invalid_attempts: int = 0
    cancels_refused: int = 0

    def legal_targets(self) -> set[str]:
        if self.state == "TRACING":
            return {FINAL_FOR_CAUSE[self.cause]}
        return EXPECTED_EDGES.get(self.state, set())

    def move(self, target: str) -> None:
        assert target in self.legal_targets() or (self.state, target) in {
            (source, "FAILED") for source in ("CREATED", "POLICY_CHECK", "TRACING")
        }, f"the model itself took an illegal edge {self.state} → {target}"
        if target == "TRACING":
            self.cause = {
                "EXECUTING": "succeeded", "REJECTED": "rejected", "FAILED": "failed", "CANCELLED": "cancelled",
                "TIMEOUT": TIMEOUT_CAUSE.get(self.previous),
            }[self.state]
        self.previous, self.state = self.state, target

    def close(self) -> None:
        if self.state in TRANSIENT:
            self.move("TRACING")
        if self.state == "TRACING":
            self.move(FINAL_FOR_CAUSE[self.cause])
            if self.cancel_requested and self.state != "CLOSED_CANCELLED":
                self.cancels_superseded += 1


class RunLifecycle(RuleBasedStateMachine):
    """Bound to the test's ``make_run`` factory and user by the test below."""

    make_run = None
    user = None

    def __init__(self):
        super().__init__()
        self.expected: dict[int, Expected] = {}
        self.seen_final: dict[int, str] = {}

    # --- choosing runs ------------------------------------------------------

    def _runs_in(self, states) -> list[int]:
        return [run_id for run_id, model in self.expected.items() if model.state in states]

    def _pick(self, data, states=STATES) -> int:
        return data.draw(st.sampled_from(sorted(self._runs_in(states))), label="run")

    def _move(self, data, sources, target: str, caller: str) -> None:
        run_id = self._pick(data, sources)
        run_transition(run_id, target, caller=caller, expected=self.expected[run_id].state)
        self.expected[run_id].move(target)

    # --- rules ----------------------------------------------------------------

    @initialize(starts=st.lists(st.sampled_from(HEAD_START + ("AWAITING_HITL",)), min_size=1, max_size=3))
    def create_runs(self, starts):
        for start in starts:
            run = type(self).make_run("CREATED")
            Job.objects.filter(pk=run.job_id).update(status="pending")
            model = self.expected[run.pk] = Expected()
            path = [*HEAD_START[1:HEAD_START.index(start) + 1]] if start in HEAD_START else [
                "PREPARING", "PLANNING", "POLICY_CHECK", "AWAITING_HITL",
            ]
            for target in path:
                run_transition(run.pk, target, caller="pipeline", expected=model.state)
                model.move(target)

    @precondition(lambda self: self._runs_in(NEXT_ON_MAIN_PATH))
    @rule(data=st.data())
    def advance(self, data):
        run_id = self._pick(data, NEXT_ON_MAIN_PATH)
        target = NEXT_ON_MAIN_PATH[self.expected[run_id].state]
        run_transition(run_id, target, caller="pipeline", expected=self.expected[run_id].state)
        self.expected[run_id].move(target)

    @precondition(lambda self: self._runs_in({"POLICY_CHECK"}))
    @rule(data=st.data())
    def request_approval(self, data):
        # The policy gate decides high risk; here the edge is taken directly.
        self._move(data, {"POLICY_CHECK"}, "AWAITING_HITL", "hitl controller")

    @precondition(lambda self: self._runs_in({"AWAITING_HITL"}))
    @rule(data=st.data())
    def approve(self, data):
        self._move(data, {"AWAITING_HITL"}, "EXECUTING", "hitl controller")

    @precondition(lambda self: self._runs_in({"POLICY_CHECK", "AWAITING_HITL"}))
    @rule(data=st.data())
    def reject(self, data):
        self._move(data, {"POLICY_CHECK", "AWAITING_HITL"}, "REJECTED", "hitl controller")

    @precondition(lambda self: self._runs_in({"PREPARING", "PLANNING", "EXECUTING"}))
    @rule(data=st.data())
    def fail(self, data):
        self._move(data, {"PREPARING", "PLANNING", "EXECUTING"}, "FAILED", "tool controller")

    @precondition(lambda self: self._runs_in({"PLANNING", "AWAITING_HITL", "EXECUTING"}))
    @rule(data=st.data())
    def timeout(self, data):
        self._move(data, {"PLANNING", "AWAITING_HITL", "EXECUTING"}, "TIMEOUT", "tool controller")

    @precondition(lambda self: self._runs_in({"AWAITING_HITL", "EXECUTING"}))
    @rule(data=st.data())
    def cancel_edge(self, data):
        self._move(data, {"AWAITING_HITL", "EXECUTING"}, "CANCELLED", "user")

    @rule(data=st.data())
    def cancel_request(self, data):
        run_id = self._pick(data)
        model = self.expected[run_id]
        if model.state in FINAL:
            with pytest.raises(ConflictError):
                run_cancel(run=Run.objects.get(pk=run_id), user=self.user)
            model.cancels_refused += 1
            return
        if model.state in {"REJECTED", "FAILED", "TIMEOUT"} or (model.state == "TRACING"
                                                                and model.cause != "cancelled"):
            # Its ending is decided: the cancel is refused at once, audited as superseded.
            with pytest.raises(ConflictError):
                run_cancel(run=Run.objects.get(pk=run_id), user=self.user)
            model.cancels_superseded += 1
            return
        run_cancel(run=Run.objects.get(pk=run_id), user=self.user)
        model.cancel_requested = True
        if model.state == "AWAITING_HITL":
            model.move("CANCELLED")
            model.close()

    @precondition(lambda self: self._runs_in(set(STATES) - set(FINAL)))
    @rule(data=st.data())
    def sweep(self, data):
        run_id = self._pick(data, set(STATES) - set(FINAL))
        model = self.expected[run_id]
        assert sweep_run(Run.objects.get(pk=run_id), age=timedelta(days=30)) is True
        if model.state not in TRANSIENT:
            model.move(SWEEPER_EDGE[model.state])
        model.close()
        assert list(AuditLog.objects.filter(run_id=run_id, forced_by=ZOMBIE_SWEEPER,
                                            event__startswith="zombie_").values_list("event", flat=True))[-2:] == [
            "zombie_detected", "zombie_recovered",
        ]

    @rule(data=st.data())
    def close(self, data):
        run_id = self._pick(data)
        closed = run_close(run_id)
        self.expected[run_id].close()
        assert closed.state == self.expected[run_id].state

    @rule(data=st.data())
    def illegal_attempt(self, data):
        run_id = self._pick(data)
        model = self.expected[run_id]
        target = data.draw(st.sampled_from(sorted(set(STATES) - model.legal_targets())), label="target")
        with pytest.raises(InvalidTransitionError):
            run_transition(run_id, target, caller="property test")
        model.invalid_attempts += 1

    @precondition(lambda self: self._runs_in(FINAL) and len(self.expected) < MAX_RUNS)
    @rule(data=st.data())
    def retry(self, data):
        old = Run.objects.get(pk=self._pick(data, FINAL))
        new = run_retry(run=old, user=self.user)
        assert (new.retry_of_id, new.job_id, new.state) == (old.pk, old.job_id, "CREATED")
        self.expected[new.pk] = Expected()

    # --- invariants -------------------------------------------------------------

    @invariant()
    def rows_match_the_model(self):
        rows = {pk: (state, cause) for pk, state, cause in
                Run.objects.filter(pk__in=self.expected).values_list("pk", "state", "closing_cause")}
        assert set(rows) == set(self.expected)
        for run_id, model in self.expected.items():
            state, cause = rows[run_id]
            assert state in STATES
            assert state == model.state, f"run {run_id}: {state}, the model says {model.state}"
            if model.cause:
                assert cause == model.cause, f"run {run_id}: closing cause {cause}, the model says {model.cause}"

    @invariant()
    def final_states_never_change(self):
        for run_id, state in Run.objects.filter(pk__in=self.expected).values_list("pk", "state"):
            if run_id in self.seen_final:
                assert state == self.seen_final[run_id], f"run {run_id} left final state {self.seen_final[run_id]}"
            elif state in FINAL:
                self.seen_final[run_id] = state

    @invariant()
    def every_final_run_passed_tracing(self):
        for run_id, state in self.seen_final.items():
            last = Trace.objects.filter(run_id=run_id, kind="transition").order_by("-id").first()
            assert (last.from_state, last.to_state) == ("TRACING", state)
            assert Event.objects.filter(run_id=run_id).order_by("-id").first().data["to"] == state

    @invariant()
    def job_status_is_the_projection_of_its_latest_run(self):
        for job in Job.objects.filter(runs__pk__in=self.expected).distinct().select_related("latest_run"):
            assert job.status == JOB_STATUS[job.latest_run.state], f"job {job.pk}"
            assert job.latest_run_id == max(job.runs.values_list("pk", flat=True))

    @invariant()
    def audit_log_matches_the_model(self):
        for run_id, model in self.expected.items():
            events = list(AuditLog.objects.filter(run_id=run_id).values_list("event", flat=True))
            assert events.count("invalid_transition") == model.invalid_attempts
            assert events.count("cancel_superseded") == model.cancels_superseded
            assert events.count("cancel_refused") == model.cancels_refused

    @invariant()
    def reconciliation_holds(self):
        assert find_violations() == []

    def teardown(self):
        Trace.objects.all().delete()
        erase_audit_log()
        Job.objects.update(latest_run=None)
        Run.objects.update(retry_of=None)
        Run.objects.all().delete()
        Job.objects.all().delete()



@pytest.mark.django_db(transaction=True, databases=["default", "audit"])
@pytest.mark.parametrize("share", [1, 2])  # 2 × 20 random programs: parallel test processes share the 40
def test_random_operations_keep_every_invariant(make_run, agent, share):
    bound = type("BoundRunLifecycle", (RunLifecycle,), {"make_run": staticmethod(make_run), "user": agent})
    run_state_machine_as_test(
        bound,
        settings=settings(max_examples=20, stateful_step_count=30, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow]),
    )
