"""A tenant's staff in Debian's Chromium against a live Daphne server:
they add a rule in the admin and preview it before saving; the preview
lists the steps of their runs whose rating would flip, each with a link to
its run, and nothing is saved until they go back and save it."""

import pytest
from django.contrib.auth.models import Permission, User
from playwright.sync_api import expect

from policy.interface import current_policy_version
from policy.models import PolicyRule
from runs.pipeline import run_advance
from runs.services import run_submit
from tests.conftest import make_user
from tests.pages.conftest import PASSWORD, log_in, screenshot

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def staff(tenant):
    user = make_user("carol", tenant)
    user.set_password(PASSWORD)
    user.is_staff = True
    user.save()
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="policy"))
    return User.objects.get(pk=user.pk)


def test_staff_preview_a_rule_over_their_runs_then_save_it(page, seeded_policy, staff, tenant, agent):
    run_ids = []
    for argv in (["curl", "-s", "https://example.com"], ["echo", "hello"], ["curl", "https://example.org"]):
        run_id = run_submit(tenant=tenant, user=agent, plan={"steps": [
            {"id": "fetch", "tool": "shell", "params": {"argv": argv}}]}).run.pk
        run_advance(run_id)
        run_ids.append(run_id)
    version = current_policy_version(tenant.pk)

    log_in(page, "carol", PASSWORD)
    page.goto("/admin/policy/policyrule/add/")
    page.get_by_label("Name").fill("curl-needs-a-human")
    page.get_by_label("Tool").select_option("shell")
    page.get_by_label("Field").select_option("words")
    page.get_by_label("Pattern").fill(r"^curl\b")
    page.get_by_label("Outcome").select_option("high")
    page.get_by_label("Reason").fill("fetches from the web")
    page.get_by_role("button", name="Preview what this change would do").click()

    expect(page.locator("#replay-summary")).to_contain_text("Adding the rule curl-needs-a-human")
    rows = page.locator("#replay-flips tbody tr")
    expect(rows).to_have_count(2)
    linked = {int(href.strip("/").split("/")[-1]) for href in
              page.locator("#replay-flips tbody a").evaluate_all("links => links.map(a => a.getAttribute('href'))")}
    assert linked == {run_ids[0], run_ids[2]}
    screenshot(page, "policy-rule-preview")
    assert not PolicyRule.objects.filter(name="curl-needs-a-human").exists()
    assert current_policy_version(tenant.pk) == version

    page.go_back()  # the form as it was left
    expect(page.get_by_label("Pattern")).to_have_value(r"^curl\b")
    page.get_by_role("button", name="Save", exact=True).click()
    expect(page.locator(".messagelist")).to_contain_text("curl-needs-a-human")
    assert PolicyRule.objects.get(name="curl-needs-a-human").tenant_id == tenant.pk
    assert current_policy_version(tenant.pk) == version + 1
