"""The approvers' pages, through Django's test client: the inbox of pending
and decided requests (for approvers only); the request page with the exact
command, its risk, reason and digest; decisions by its CSRF-protected forms
(a reject needs a reason, GET and non-approvers are refused); the history
once decided; and the edit form, which changes only what the approver
changed."""

import re
from html.parser import HTMLParser

import pytest
from django.test import Client
from django.urls import reverse

from approvals.models import ApprovalRequest, Decision
from runs.models import Run
from tests.approvals.interfaces_helpers import (
    PACKAGE_INSTALL_REASON,
    add_shell_steps,
    messages_of,
    rated_approval,
    run_of,
    signed_in,
    snapshot,
    waiting_run,
)
from tests.conftest import make_user, open_approval, token_client

pytestmark = pytest.mark.django_db


class _Forms(HTMLParser):
    """The forms of a page: action, method, inputs (name → value) and buttons' ids."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.forms: list[dict] = []
        self.buttons: list[dict] = []
        self._open: dict | None = None

    def handle_starttag(self, tag, attrs):
        attrs = {name: value or "" for name, value in attrs}
        if tag == "form":
            self._open = {"action": attrs.get("action", ""), "method": attrs.get("method", "get").lower(),
                          "inputs": {}, "buttons": []}
            self.forms.append(self._open)
        elif tag == "input" and self._open is not None and attrs.get("name"):
            self._open["inputs"][attrs["name"]] = attrs.get("value", "")
        elif tag == "button":
            self.buttons.append(attrs)
            if self._open is not None:
                self._open["buttons"].append(attrs.get("id", ""))

    handle_startendtag = handle_starttag

    def handle_endtag(self, tag):
        if tag == "form":
            self._open = None


def parse_forms(html: str) -> _Forms:
    parser = _Forms()
    parser.feed(html)
    return parser


def decide_forms(html: str, approval: ApprovalRequest) -> dict[str, dict]:
    """The page's decision forms by verdict."""
    urls = {reverse("approvals:approve", args=[approval.pk]): "approve",
            reverse("approvals:reject", args=[approval.pk]): "reject"}
    return {urls[form["action"]]: form for form in parse_forms(html).forms if form["action"] in urls}


# --- pages: the inbox -------------------------------------------------------------------------


def inbox_row(html: str, approval: ApprovalRequest) -> str:
    match = re.search(rf'<tr id="approval-{approval.pk}" data-status="(\w+)"[^>]*>(.*?)</tr>', html, re.S)
    assert match, f"request {approval.pk} not listed"
    return match.group(0)


def test_the_inbox_lists_pending_requests_with_risk_and_time_left(make_run, alice, outsider):
    first = open_approval(waiting_run(make_run))
    second = open_approval(waiting_run(make_run), expires_in_s=2 * 3600 + 120)
    decided = open_approval(waiting_run(make_run))
    theirs = open_approval(run_of(outsider.membership.tenant, outsider))
    assert token_client(make_user("bob", alice.membership.tenant, groups=("approvers",))).post(
        f"/api/v1/approvals/{decided.pk}/approve", {"digest": decided.action_digest}, format="json").status_code == 200

    response = signed_in(alice).get("/approvals/")
    assert response.status_code == 200
    html = response.content.decode()
    assert re.findall(r'<tr id="approval-(\d+)"', html) == [str(second.pk), str(first.pk)]
    assert f'id="approval-{theirs.pk}"' not in html and f'id="approval-{decided.pk}"' not in html
    for approval, left in ((first, r"59\s+minutes"), (second, r"2\s+hours,\s+1\s+minute")):
        row = inbox_row(html.replace("\xa0", " "), approval)
        assert 'data-status="pending"' in row
        assert '<span class="badge risk-high">high</span>' in row, row
        assert re.search(rf'<time datetime="[^"]+">{left}</time> left', row), row
        assert f'href="/approvals/{approval.pk}/"' in row
    assert "Waiting · time left" in html


def test_the_inbox_lists_decided_requests_with_their_outcome(make_run, alice, bob):
    approved = open_approval(waiting_run(make_run))
    rejected = open_approval(waiting_run(make_run))
    still_pending = open_approval(waiting_run(make_run))
    api = token_client(bob)
    assert api.post(f"/api/v1/approvals/{approved.pk}/approve", {"digest": approved.action_digest}, format="json").status_code == 200
    assert api.post(f"/api/v1/approvals/{rejected.pk}/reject", {"digest": rejected.action_digest, "comment": "no"}, format="json").status_code == 200

    html = signed_in(alice).get("/approvals/?status=decided").content.decode()
    assert re.findall(r'<tr id="approval-(\d+)"', html) == [str(rejected.pk), str(approved.pk)]
    assert f'id="approval-{still_pending.pk}"' not in html
    assert "<strong>approved</strong>" in inbox_row(html, approved)
    assert "<strong>rejected</strong>" in inbox_row(html, rejected)
    assert "Outcome" in html and "time left" not in html


def test_the_inbox_is_for_approvers_only(tenant, pending, agent):
    clerk = make_user("clerk", tenant)
    for user in (clerk, agent):
        assert signed_in(user).get("/approvals/").status_code == 403
        assert signed_in(user).get(f"/approvals/{pending.pk}/").status_code == 403
    response = Client().get("/approvals/")
    assert (response.status_code, response["Location"]) == (302, "/accounts/login/?next=/approvals/")
    response = Client().get(f"/approvals/{pending.pk}/")
    assert (response.status_code, response["Location"]) == (302, f"/accounts/login/?next=/approvals/{pending.pk}/")


# --- pages: one request -------------------------------------------------------------------------


@pytest.fixture
def high_risk(seeded_policy, make_run):
    run = waiting_run(make_run)
    add_shell_steps(run, ["echo", "hi"], ["pip", "install", "--user", "requests==2.32.3"])
    return rated_approval(run)


def test_the_request_page_shows_the_exact_command_the_reason_and_the_digest(high_risk, alice):
    response = signed_in(alice).get(f"/approvals/{high_risk.pk}/")
    assert response.status_code == 200
    html = response.content.decode()
    article = re.search(r'<article class="step" data-step="s1"[^>]*>(.*?)</article>', html, re.S)
    assert article, html
    assert "border-color:#dc2626" in article.group(0)
    assert '<span class="badge risk-high">high</span>' in article.group(1)
    # argv as a list, one argument an item (never a joined string)
    assert ('<ol class="argv" data-field="argv"><li><code>pip</code></li><li><code>install</code></li>'
            '<li><code>--user</code></li><li><code>requests==2.32.3</code></li></ol>') in article.group(1)
    assert f"<li>{PACKAGE_INSTALL_REASON}</li>" in article.group(1)
    low = re.search(r'<article class="step" data-step="s0"[^>]*>(.*?)</article>', html, re.S)
    assert low and '<li><code>echo</code></li><li><code>hi</code></li></ol>' in low.group(1)
    assert "border-color" not in low.group(0)
    assert high_risk.action_digest in html

    forms = decide_forms(html, high_risk)
    assert set(forms) == {"approve", "reject"}
    for verdict, form in forms.items():
        assert form["method"] == "post"
        assert len(form["inputs"]["csrfmiddlewaretoken"]) >= 32, form
        assert "comment" in form["inputs"]
        assert form["inputs"]["digest"] == high_risk.action_digest
        assert form["buttons"] == [verdict]
    assert "No decision yet." in html


def test_the_request_page_escapes_the_command(seeded_policy, make_run, alice):
    run = waiting_run(make_run)
    add_shell_steps(run, ["pip", "install", "<script>alert(1)</script>"])
    approval = rated_approval(run)
    html = signed_in(alice).get(f"/approvals/{approval.pk}/").content.decode()
    assert '<li><code>&lt;script&gt;alert(1)&lt;/script&gt;</code></li>' in html
    assert "<script>alert(1)" not in html


def csrf_page(user, approval: ApprovalRequest) -> tuple[Client, dict[str, dict]]:
    client = signed_in(user, enforce_csrf_checks=True)
    response = client.get(f"/approvals/{approval.pk}/")
    assert response.status_code == 200
    return client, decide_forms(response.content.decode(), approval)


def test_approving_on_the_page_with_the_csrf_token(high_risk, alice):
    client, forms = csrf_page(alice, high_risk)
    assert forms["approve"]["inputs"]["digest"] == high_risk.action_digest  # the view it was made on
    response = client.post(forms["approve"]["action"], {**forms["approve"]["inputs"], "comment": "checked the pin"})
    assert (response.status_code, response["Location"]) == (302, f"/approvals/{high_risk.pk}/")
    high_risk.refresh_from_db()
    assert high_risk.status == "approved"
    assert Run.objects.get(pk=high_risk.run_id).state == "EXECUTING"
    assert list(Decision.objects.filter(request=high_risk).values_list("decider__username", "decision", "comment")) \
        == [("alice", "approve", "checked the pin")]
    page = client.get(response["Location"])
    assert "Request approved." in messages_of(page)


@pytest.mark.parametrize("verdict", ["approve", "reject"])
def test_a_page_decision_without_the_csrf_token_is_a_403(high_risk, alice, verdict):
    client, forms = csrf_page(alice, high_risk)
    before = snapshot(high_risk)
    response = client.post(forms[verdict]["action"], {"comment": "no token"})
    assert response.status_code == 403
    response = client.post(forms[verdict]["action"], {"comment": "bad token", "csrfmiddlewaretoken": "x" * 64})
    assert response.status_code == 403
    assert snapshot(high_risk) == before
    assert not Decision.objects.exists()


@pytest.mark.parametrize("comment", ["", "   "])
def test_a_page_reject_without_a_reason_is_refused_with_a_message(high_risk, alice, comment):
    client, forms = csrf_page(alice, high_risk)
    before = snapshot(high_risk)
    response = client.post(forms["reject"]["action"], {**forms["reject"]["inputs"], "comment": comment}, follow=True)
    assert response.redirect_chain == [(f"/approvals/{high_risk.pk}/", 302)]
    assert "A rejection needs a reason." in messages_of(response)
    assert "A rejection needs a reason." in response.content.decode()
    assert snapshot(high_risk) == before
    assert before[:3] == ("pending", None, "AWAITING_HITL")
    assert set(decide_forms(response.content.decode(), high_risk)) == {"approve", "reject"}


@pytest.mark.parametrize("verdict", ["approve", "reject"])
def test_a_page_decision_by_get_is_a_405(high_risk, alice, verdict):
    before = snapshot(high_risk)
    assert signed_in(alice).get(f"/approvals/{high_risk.pk}/{verdict}").status_code == 405
    assert snapshot(high_risk) == before


def test_a_non_approver_of_the_tenant_cannot_decide_on_the_page(tenant, high_risk):
    clerk = make_user("clerk", tenant)
    before = snapshot(high_risk)
    response = signed_in(clerk).post(f"/approvals/{high_risk.pk}/approve", {"digest": high_risk.action_digest, "comment": "me too"}, follow=True)
    assert response.status_code == 403  # refused by the service, then the page is not theirs to see
    assert snapshot(high_risk) == before
    assert not Decision.objects.exists()


def test_after_a_decision_the_page_shows_the_history_and_no_buttons(high_risk, alice):
    client, forms = csrf_page(alice, high_risk)
    response = client.post(forms["reject"]["action"], {**forms["reject"]["inputs"], "comment": "pin <the> index"},
                           follow=True)
    assert response.status_code == 200
    assert "Request rejected." in messages_of(response)
    html = response.content.decode()
    assert re.search(r"<strong>reject</strong> by alice: “pin &lt;the&gt; index”", html), html
    assert "No decision yet." not in html
    assert decide_forms(html, high_risk) == {}
    # No decision form of any kind is left (only the layout's log-out form).
    assert [form["action"] for form in parse_forms(html).forms] == [reverse("logout")]
    assert not [button for button in parse_forms(html).buttons if button.get("id", "").startswith(("approve",
                                                                                                    "reject"))]
    assert re.search(r'<dd id="approval-status"><strong>rejected</strong>', html)
    assert Run.objects.get(pk=high_risk.run_id).state == "CLOSED_REJECTED"


def test_the_edit_form_changes_only_the_fields_the_approver_changed(high_risk, alice):
    """A browser posts every field of the form, untouched ones as rendered
    (with CRLF line ends): only the changed step becomes an edit."""
    client, _ = csrf_page(alice, high_risk)
    html = client.get(f"/approvals/{high_risk.pk}/").content.decode()
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html).group(1)
    response = client.post(f"/approvals/{high_risk.pk}/approve-edited", {
        "csrfmiddlewaretoken": csrf, "digest": high_risk.action_digest, "comment": "",
        "edit-0-argv": "echo\r\nhi", "edit-1-argv": "pip\r\ninstall\r\n--user\r\nrequests==2.32.4\r\n"})
    assert response.status_code == 302
    decision = Decision.objects.get(request=high_risk)
    assert decision.edits == {"s1": {"argv": ["pip", "install", "--user", "requests==2.32.4"]}}
    high_risk.refresh_from_db()
    assert [row.get("edited") for row in high_risk.steps] == [False, True]
    assert decision.digest == high_risk.action_digest
