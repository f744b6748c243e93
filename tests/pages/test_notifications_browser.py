"""An approver in Debian's Chromium against a live Daphne server follows
the link of their notification: not signed in, the link shows the login
page and decides nothing; signed in, it shows the request, and Approve
decides it once. Their settings page refuses a chat URL off the operator's
list. Screenshots under var/screenshots/."""

import re

import pytest
from django.core import mail
from django.test import override_settings
from playwright.sync_api import expect

from approvals.models import ApprovalRequest, Notification
from approvals.notify import notification_send, notify_request
from tests.conftest import make_user
from tests.pages.conftest import PASSWORD, screenshot
from tests.pages.test_approvals_browser import make_plain_run, open_for_run

pytestmark = pytest.mark.django_db(transaction=True)


@override_settings(EMAIL_BACKEND="django.core.mail.backends.locmem.EmailBackend")
def test_a_link_from_a_mail_shows_the_login_then_the_request_and_approve_decides_once(
        page, live_web, seeded_policy, echo_pip_install_is_high, approver, agent, tenant):
    approver.email = "alice@example.com"
    approver.save()
    approval = open_for_run(make_plain_run(tenant, agent), approvals_required=1)
    with override_settings(EXECGO_PUBLIC_URL=live_web.url):
        notify_request(approval, "requested")
        for row in Notification.objects.filter(request=approval):
            notification_send(row.pk)
    [message] = mail.outbox
    link = re.search(r"Decide: (\S+)", message.body).group(1)

    page.goto(link)  # as a mail scanner would: no session
    expect(page).to_have_url(re.compile(r"/accounts/login/\?next=/approvals/link/"))
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "pending"
    page.get_by_label("Username").fill("alice")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    expect(page.locator("h1")).to_contain_text(f"Approval #{approval.pk}")
    expect(page.locator("[data-step=s0]")).to_contain_text("echo")
    screenshot(page, "decision-link")
    page.get_by_role("button", name="Approve", exact=True).click()
    expect(page.locator(".messages")).to_contain_text("Request approved.")
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "approved"

    page.goto(link)
    expect(page.locator("#link-refused")).to_contain_text("used already")


def test_the_settings_page_takes_channels_and_refuses_a_chat_host_off_the_list(page, live_web, tenant):
    user = make_user("carol", tenant, groups=("approvers",))
    user.set_password(PASSWORD)
    user.save()
    page.goto("/accounts/login/")
    page.get_by_label("Username").fill("carol")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    page.goto("/approvals/settings/")
    page.get_by_label("Chat incoming-webhook URL").fill("http://169.254.169.254/latest")
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#chat-url-errors")).to_contain_text("not one of the chat webhook hosts")
    page.get_by_label("Chat incoming-webhook URL").fill("https://hooks.slack.com/services/T0/B0/x")
    page.get_by_label("Chat format").select_option("teams")
    page.get_by_role("button", name="Save").click()
    expect(page.locator(".messages")).to_contain_text("Notification settings saved.")
    screenshot(page, "notification-settings")
