"""Approvers in Debian's Chromium against a live Daphne server and a real
worker: a request appears in the inbox without reload, shows the exact
command, and Approve runs it; Reject with a reason closes the run rejected
and the reason is on the run page. Screenshots under var/screenshots/."""

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from approvals.interface import open_request
from approvals.models import ApprovalRequest
from policy.interface import evaluate_policy
from runs.models import AuditLog, Job, Run, Step
from tests.conftest import make_user, token_client, wait_for_run, wait_until
from tests.pages.conftest import PASSWORD, log_in, screenshot

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("echo_pip_install_is_high")]

# Rated high by the seeded policy (it names a package install) and harmless to run.
HIGH_RISK_SCRIPT = "echo pip install --dry-run nothing"


def submit_high_risk(agent) -> int:
    plan = {"steps": [{"id": "prep", "tool": "shell", "params": {"argv": ["echo", "ready"]}},
                      {"id": "install", "tool": "shell", "params": {"script": HIGH_RISK_SCRIPT},
                       "depends_on": ["prep"]}]}
    response = token_client(agent).post("/api/v1/runs", {"title": "needs a human", "plan": plan}, format="json")
    assert response.status_code == 201, response.content
    return response.json()["id"]


def pending_request(run_id: int) -> ApprovalRequest:
    wait_until(lambda: ApprovalRequest.objects.filter(run_id=run_id, status="pending").exists(), timeout=30,
               what="the approval request")
    return ApprovalRequest.objects.get(run_id=run_id, status="pending")


def test_an_approver_sees_the_request_arrive_and_approves_it(page, celery_worker, seeded_policy, approver, agent):
    log_in(page, "alice", PASSWORD)
    page.goto("/approvals/")
    page.wait_for_function("window.execgoLive && window.execgoLive.state === 'live'")
    page.evaluate("window.loadedOnce = true")

    run_id = submit_high_risk(agent)
    approval = pending_request(run_id)
    page.locator(f"#approval-{approval.pk}").wait_for(timeout=15_000)  # no reload
    assert page.evaluate("window.loadedOnce") is True
    screenshot(page, "approvals-inbox")

    page.locator(f"#approval-{approval.pk} a").first.click()
    expect(page.locator("[data-step=install] pre.command")).to_have_text(HIGH_RISK_SCRIPT)
    assert "stands for a package install in tests" in page.locator("[data-step=install]").inner_text()
    assert approval.action_digest in page.locator("main").inner_text()
    screenshot(page, "approval-request")
    page.get_by_role("button", name="Approve", exact=True).click()

    run = wait_for_run(run_id, timeout=60)
    assert run.state == "SUCCEEDED"
    assert run.steps.get(step_id="install").result["output"]["stdout"] == "pip install --dry-run nothing\n"
    approval.refresh_from_db()
    assert approval.status == "approved"
    assert list(approval.decisions.values_list("decider__username", "decision")) == [("alice", "approve")]
    page.reload()
    assert "approve by alice" in page.locator("#history-title + *").inner_text() or \
        "alice" in page.locator("main").inner_text()
    assert page.get_by_role("button", name="Approve", exact=True).count() == 0
    screenshot(page, "approval-decided")


def test_an_approver_rejects_with_a_reason_shown_on_the_run_page(page, celery_worker, seeded_policy, approver,
                                                                 agent):
    log_in(page, "alice", PASSWORD)
    run_id = submit_high_risk(agent)
    approval = pending_request(run_id)
    page.goto(f"/approvals/{approval.pk}/")

    page.get_by_role("button", name="Reject").click()  # the reason is required: the browser refuses
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "pending"
    page.get_by_label("Reason (required)").fill("not on a shared host")
    page.get_by_role("button", name="Reject").click()

    run = wait_for_run(run_id, timeout=30)
    assert (run.state, run.closing_cause) == ("CLOSED_REJECTED", "rejected")
    assert not run.steps.exclude(run_status="").exists()  # nothing ran
    page.goto(f"/runs/{run_id}/")
    approval_section = page.locator("#approval-title + *")
    expect(page.locator("main")).to_contain_text("not on a shared host")
    assert "reject" in approval_section.inner_text()
    screenshot(page, "run-rejected")
    assert Run.objects.get(pk=run_id).state == "CLOSED_REJECTED"


def test_approve_with_an_edited_argv_runs_the_edited_command(page, celery_worker, seeded_policy, approver, agent):
    plan = {"steps": [{"id": "install", "tool": "shell", "params": {"argv": ["echo", "pip", "install", "everything"]}}]}
    response = token_client(agent).post("/api/v1/runs", {"title": "edit me", "plan": plan}, format="json")
    run_id = response.json()["id"]
    approval = pending_request(run_id)
    log_in(page, "alice", PASSWORD)
    page.goto(f"/approvals/{approval.pk}/")

    page.get_by_label("install: argv, one argument per line").fill("echo\nnarrowed")
    page.get_by_role("button", name="Approve with edits").click()

    run = wait_for_run(run_id, timeout=60)
    assert run.state == "SUCCEEDED"
    step = run.steps.get()
    assert step.params["argv"] == ["echo", "narrowed"]
    assert step.result["output"]["stdout"] == "narrowed\n"  # what ran is what was approved
    approval.refresh_from_db()
    assert approval.status == "approved" and approval.edited_by.username == "alice"
    assert approval.original_steps[0]["action"]["argv"] == ["echo", "pip", "install", "everything"]
    assert approval.steps[0]["action"]["argv"] == ["echo", "narrowed"]
    page.goto(f"/approvals/{approval.pk}/")
    expect(page.locator("main")).to_contain_text("edited by alice")
    expect(page.locator("main")).to_contain_text("echo pip install everything")  # the original, kept and shown
    screenshot(page, "approval-edited")
    # The agent sees that its plan was edited, and by whom.
    body = token_client(agent).get(f"/api/v1/runs/{run_id}").json()
    assert body["plan"]["steps"][0]["params"]["argv"] == ["echo", "narrowed"]
    page.goto(f"/runs/{run_id}/")
    expect(page.locator("#approval-title + *")).to_contain_text("edited by alice")
    # Proposed, approved and executed side by side: the edit is marked, and what ran is what was approved.
    cells = page.locator("#plan-versions tr[data-step=install] td")
    proposed, approved, executed = (cells.nth(index).locator("pre").inner_text() for index in range(3))
    assert proposed.startswith("argv ['echo', 'pip', 'install', 'everything']")
    assert approved.startswith("argv ['echo', 'narrowed']")
    assert executed.split("\n")[0] == approved.split("\n")[0]
    assert "plan linux_sandbox, network none, filesystem workspace" in executed
    assert cells.nth(1).get_attribute("class") == "changed"
    screenshot(page, "run-plan-versions")


def test_a_view_that_went_stale_is_told_live_and_its_decision_refused(browser, live_web, seeded_policy,
                                                                       echo_pip_install_is_high, approver, agent,
                                                                       tenant):
    """Two approvers needed. alice and bob open the request in their own
    browsers; bob approves with edits; alice's page says at once that it
    changed, and her Approve on it is refused: the request stays pending,
    with a stale_view audit row and no decision of hers."""
    bob = make_user("bob", tenant, groups=("approvers",))
    bob.set_password(PASSWORD)
    bob.save()
    run = make_plain_run(tenant, agent)
    approval = open_for_run(run, approvals_required=2)

    pages = {}
    for name in ("alice", "bob"):
        context = browser.new_context(viewport={"width": 1280, "height": 900}, base_url=live_web.url)
        pages[name] = context.new_page()
        log_in(pages[name], name, PASSWORD)
        pages[name].goto(f"/approvals/{approval.pk}/")
        pages[name].wait_for_function("window.execgoLive && window.execgoLive.state === 'live'")
    alice, bob_page = pages["alice"], pages["bob"]
    expect(alice.locator("#approval-stale")).to_be_hidden()

    bob_page.get_by_label("s0: argv, one argument per line").fill("echo\npip\ninstall\none")
    bob_page.get_by_role("button", name="Approve with edits").click()
    expect(bob_page.locator("main")).to_contain_text("1 of 2 approvals so far")
    expect(alice.locator("#approval-stale")).to_be_visible(timeout=15_000)  # live, no reload
    expect(alice.locator("#approval-stale")).to_contain_text("edited by bob")
    screenshot(alice, "approval-stale-view")

    alice.get_by_role("button", name="Approve", exact=True).click()
    expect(alice.locator("main")).to_contain_text("the plan changed since you opened it: reload")
    approval.refresh_from_db()
    assert approval.status == "pending"
    assert list(approval.decisions.values_list("decider__username", flat=True)) == ["bob"]
    assert AuditLog.objects.filter(event="approval_stale_view", run_id=run.pk, actor=approver).count() == 1
    for page in pages.values():
        page.context.close()


def make_plain_run(tenant, agent) -> Run:
    """A run waiting for approval of one harmless step, as the pipeline leaves it (no worker needed)."""
    job = Job.objects.create(tenant=tenant, created_by=agent)
    run = Run.objects.create(job=job, tenant=tenant, submitted_by=agent, state="AWAITING_HITL",
                             previous_state="POLICY_CHECK", timeout_s=600, approval_timeout_s=3600,
                             plan={"steps": [{"id": "s0", "tool": "shell", "params": {"argv": ["echo", "pip",
                                                                                                "install", "all"]}}]},
                             last_state_change_at=timezone.now())
    Step.objects.create(run=run, step_id="s0", position=0, tool="shell",
                        params={"argv": ["echo", "pip", "install", "all"]}, timeout_s=5)
    return run


def open_for_run(run: Run, *, approvals_required: int) -> ApprovalRequest:
    decision = evaluate_policy(run)
    approval = open_request(run, decision.data, now=timezone.now())
    ApprovalRequest.objects.filter(pk=approval.pk).update(approvals_required=approvals_required)
    approval.refresh_from_db()
    return approval


def test_a_bulk_approve_decides_the_rows_as_shown_and_reports_the_one_that_changed(page, seeded_policy,
                                                                                    echo_pip_install_is_high,
                                                                                    approver, agent, tenant):
    """alice selects three requests in the inbox; bob then edits one (two
    approvers needed there). The inbox does not refresh under her selection
    (it says there is news); her "Approve selected" decides the two others
    and reports the edited one, which stays pending."""
    runs = [make_plain_run(tenant, agent) for _ in range(3)]
    first, edited, third = (open_for_run(run, approvals_required=2 if index == 1 else 1)
                            for index, run in enumerate(runs))
    log_in(page, "alice", PASSWORD)
    page.goto("/approvals/")
    page.wait_for_function("window.execgoLive && window.execgoLive.state === 'live'")
    expect(page.locator(f"#approval-{edited.pk} .what-runs .action-line")).to_have_text("s0: echo pip install all")
    page.get_by_label("Select every request shown").check()
    expect(page.locator("#bulk-count")).to_have_text("3 selected")
    screenshot(page, "approvals-bulk-selected")

    bob = make_user("bob", tenant, groups=("approvers",))
    answer = token_client(bob).post(f"/api/v1/approvals/{edited.pk}/approve", {
        "digest": edited.action_digest, "edits": {"s0": {"argv": ["echo", "pip", "install", "one"]}}}, format="json")
    assert answer.status_code == 200, answer.content
    expect(page.locator("#inbox-changed")).to_be_visible(timeout=15_000)  # told, not refreshed
    expect(page.locator(f"#approval-{edited.pk} .what-runs .action-line")).to_have_text("s0: echo pip install all")

    page.get_by_label("Comment (a reject needs one)").fill("all three look fine")
    page.get_by_role("button", name="Approve selected").click()
    expect(page.locator(".messages")).to_contain_text(f"Approved 2 requests: #{third.pk}, #{first.pk}.")  # in the inbox's order
    expect(page.locator(".messages")).to_contain_text(
        f"#{edited.pk} was not decided: the plan changed since you opened it: reload.")
    screenshot(page, "approvals-bulk-reported")
    assert [ApprovalRequest.objects.get(pk=a.pk).status for a in (first, edited, third)] == \
        ["approved", "pending", "approved"]
    assert list(ApprovalRequest.objects.get(pk=edited.pk).decisions.values_list("decider__username", flat=True)) \
        == ["bob"]
    assert AuditLog.objects.filter(event="approval_stale_view", run_id=edited.run_id, actor=approver).count() == 1
    # The inbox now shows the one left, as it is now.
    expect(page.locator(f"#approval-{first.pk}")).to_have_count(0)
    expect(page.locator(f"#approval-{edited.pk} .what-runs .action-line")).to_have_text("s0: echo pip install one")


def test_approve_and_allow_for_an_hour_then_the_same_run_goes_on_alone_until_the_grant_is_revoked(
        page, celery_worker, seeded_policy, approver, agent):
    log_in(page, "alice", PASSWORD)
    first = submit_high_risk(agent)
    approval = pending_request(first)
    page.goto(f"/approvals/{approval.pk}/")
    page.get_by_label("Also allow the same high-risk action of agent again, without asking").select_option("1")
    screenshot(page, "approval-with-grant")
    page.get_by_role("button", name="Approve", exact=True).click()
    expect(page.locator(".messages")).to_contain_text("will not wait for a person for 1 hour")
    assert wait_for_run(first, timeout=60).state == "SUCCEEDED"

    second = submit_high_risk(agent)  # the same action: no request, it just runs
    assert wait_for_run(second, timeout=60).state == "SUCCEEDED"
    assert not ApprovalRequest.objects.filter(run_id=second).exists()
    assert AuditLog.objects.filter(event="grant_applied", run_id=second).exists()
    page.goto(f"/runs/{second}/")
    expect(page.locator("#approval-title + *")).to_contain_text("allowed again by standing grant #")
    expect(page.locator("#approval-title + *")).to_contain_text("of alice")

    page.goto("/approvals/grants/")
    row = page.locator("#grants-live tbody tr").first
    expect(row).to_contain_text(HIGH_RISK_SCRIPT)
    expect(row).to_contain_text("1 run")
    screenshot(page, "standing-grants")
    row.get_by_role("button", name="Revoke").click()
    expect(page.locator(".messages")).to_contain_text("revoked")
    expect(page.locator("#grants-live")).to_contain_text("No live grant.")

    third = submit_high_risk(agent)
    assert pending_request(third).status == "pending"  # waits for a person again
