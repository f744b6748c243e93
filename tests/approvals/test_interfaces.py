"""The approvals' three interfaces, through Django's and DRF's test clients:
the REST API (list, read, approve, reject; agents, submitters, replays,
methods and CSRF refused with the error envelope), tenant isolation over a
hundred ids with no existence oracle, the approvers' pages (inbox, request
page, CSRF-protected decisions, history), the admin action with the same
rules as the service, and the OpenAPI schema."""

import json
import re
from html.parser import HTMLParser

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from approvals.interface import open_request
from approvals.models import ApprovalRequest, ApprovalStatus, Decision
from runs.models import AuditLog, Job, Run, Step
from runs.policy import evaluate_policy
from tests.conftest import make_user, open_approval, token_client

pytestmark = pytest.mark.django_db

ENVELOPE_KEYS = {"code", "message", "retryable", "source", "details"}
PACKAGE_INSTALL_REASON = "shell-package-install: installs packages (changes the host, runs third-party install scripts)"


# --- helpers -----------------------------------------------------------------


def error_of(response, http_status: int, code: str) -> dict:
    """The error envelope of ``response``, checked for its status and shape."""
    assert response.status_code == http_status, (response.status_code, response.content[:1000])
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == ENVELOPE_KEYS, body
    assert body["error"]["code"] == code, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    assert body["error"]["retryable"] is False, body
    assert "Traceback" not in response.content.decode()
    return body["error"]


def snapshot(approval: ApprovalRequest) -> tuple:
    """What a refused call must leave as it was: the request, its run, the decisions."""
    approval.refresh_from_db()
    run = Run.objects.get(pk=approval.run_id)
    return (approval.status, approval.decided_at, run.state,
            list(Decision.objects.filter(request=approval).values_list("decider_id", "decision", "comment")))


def signed_in(user, cls=Client, **kwargs):
    client = cls(**kwargs)
    client.force_login(user)
    return client


def waiting_run(make_run, **fields) -> Run:
    return make_run("AWAITING_HITL", previous_state="POLICY_CHECK", **fields)


def run_of(tenant, user, state: str = "AWAITING_HITL") -> Run:
    """A run of another tenant than the ``make_run`` factory's."""
    job = Job.objects.create(tenant=tenant, created_by=user)
    run = Run.objects.create(job=job, tenant=tenant, submitted_by=user, state=state, previous_state="POLICY_CHECK",
                             plan={"steps": []}, timeout_s=600, approval_timeout_s=3600,
                             last_state_change_at=timezone.now())
    Job.objects.filter(pk=job.pk).update(latest_run=run)
    return run


def submitted_by(run: Run, user) -> Run:
    Run.objects.filter(pk=run.pk).update(submitted_by=user)
    run.refresh_from_db()
    return run


def add_shell_steps(run: Run, *argvs: list[str]) -> None:
    for position, argv in enumerate(argvs):
        Step.objects.create(run=run, step_id=f"s{position}", position=position, tool="shell",
                            params={"argv": argv}, depends_on=[f"s{position - 1}"] if position else [], timeout_s=5)


def rated_approval(run: Run) -> ApprovalRequest:
    """The request the pipeline opens for ``run``: its steps rated by the real policy."""
    decision = evaluate_policy(run)
    assert decision.risk == "high", decision.data
    return open_request(run, decision.data, now=timezone.now())


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


def messages_of(response) -> list[str]:
    return [str(message) for message in response.context["messages"]]


# --- fixtures ------------------------------------------------------------------


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


# --- API: list and read -----------------------------------------------------------


def test_an_approvers_token_lists_the_tenants_requests_by_status(make_run, alice, bob, outsider):
    first = open_approval(waiting_run(make_run))
    second = open_approval(waiting_run(make_run))
    decided = open_approval(waiting_run(make_run))
    theirs = open_approval(run_of(outsider.membership.tenant, outsider))
    api = token_client(alice)
    assert token_client(bob).post(f"/api/v1/approvals/{decided.pk}/approve", {"digest": decided.action_digest}, format="json").status_code == 200

    response = api.get("/api/v1/approvals?status=pending")
    assert response.status_code == 200, response.content
    assert [row["id"] for row in response.json()] == [second.pk, first.pk]
    assert {row["status"] for row in response.json()} == {"pending"}

    response = api.get("/api/v1/approvals?status=decided")
    assert response.status_code == 200, response.content
    assert [(row["id"], row["status"]) for row in response.json()] == [(decided.pk, "approved")]
    assert [(row["decider"], row["decision"]) for row in response.json()[0]["decisions"]] == [("bob", "approve")]

    everything = api.get("/api/v1/approvals").json()
    assert [row["id"] for row in everything] == [decided.pk, second.pk, first.pk]
    assert theirs.pk not in {row["id"] for row in everything}
    assert [row["id"] for row in token_client(outsider).get("/api/v1/approvals").json()] == [theirs.pk]

    error = error_of(api.get("/api/v1/approvals?status=granted"), 400, "invalid_input")
    assert "status" in error["details"]["fields"], error
    assert "granted" in error["message"], error


def test_an_approvers_token_reads_one_request(make_run, alice):
    approval = open_approval(waiting_run(make_run), approvals_required=2)
    response = token_client(alice).get(f"/api/v1/approvals/{approval.pk}")
    assert response.status_code == 200, response.content
    body = response.json()
    assert {"id", "run_id", "status", "risk", "action_digest", "approvals_required", "approvals", "steps",
            "decisions", "page_url"} <= set(body)
    approval.refresh_from_db()
    assert (body["id"], body["run_id"], body["status"], body["risk"], body["action_digest"],
            body["approvals_required"], body["approvals"], body["steps"], body["decisions"], body["page_url"]) == (
        approval.pk, approval.run_id, "pending", "high", approval.action_digest, 2, 0, approval.steps, [],
        f"/approvals/{approval.pk}/")
    assert re.fullmatch(r"[0-9a-f]{64}", body["action_digest"])


def test_the_read_shows_the_steps_and_the_decisions_so_far(seeded_policy, make_run, alice):
    run = waiting_run(make_run)
    add_shell_steps(run, ["echo", "hi"], ["pip", "install", "requests"])
    approval = rated_approval(run)
    ApprovalRequest.objects.filter(pk=approval.pk).update(approvals_required=2)
    api = token_client(alice)
    response = api.post(f"/api/v1/approvals/{approval.pk}/approve", {"digest": approval.action_digest, "comment": "fine by me"}, format="json")
    assert response.status_code == 200, response.content

    body = api.get(f"/api/v1/approvals/{approval.pk}").json()
    assert (body["status"], body["approvals"], body["approvals_required"]) == ("pending", 1, 2)
    assert [(row["decider"], row["decision"], row["comment"]) for row in body["decisions"]] == [
        ("alice", "approve", "fine by me")]
    assert [(step["action"]["argv"], step["risk"]) for step in body["steps"]] == [
        (["echo", "hi"], "low"), (["pip", "install", "requests"], "high")]
    assert PACKAGE_INSTALL_REASON in body["steps"][1]["reasons"]
    assert Run.objects.get(pk=run.pk).state == "AWAITING_HITL"


# --- API: decisions --------------------------------------------------------------------


def test_an_approvers_token_approves_and_the_run_executes(pending, alice):
    response = token_client(alice).post(f"/api/v1/approvals/{pending.pk}/approve", {"digest": pending.action_digest, "comment": "go"}, format="json")
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["id"], body["status"], body["approvals"]) == (pending.pk, "approved", 1)
    assert body["decided_at"] is not None
    assert Run.objects.get(pk=pending.run_id).state == "EXECUTING"
    assert list(Decision.objects.filter(request=pending).values_list("decider__username", "decision", "comment")) == [
        ("alice", "approve", "go")]


def test_an_approvers_token_rejects_with_a_comment_and_the_run_closes(pending, alice):
    response = token_client(alice).post(f"/api/v1/approvals/{pending.pk}/reject", {"digest": pending.action_digest, "comment": "  not today  "},
                                        format="json")
    assert response.status_code == 200, response.content
    assert response.json()["status"] == "rejected"
    assert Run.objects.get(pk=pending.run_id).state == "CLOSED_REJECTED"
    assert list(Decision.objects.filter(request=pending).values_list("decider__username", "decision", "comment")) == [
        ("alice", "reject", "not today")]


@pytest.mark.parametrize("payload", [{}, {"comment": ""}, {"comment": "   "}])
def test_a_reject_without_a_comment_is_a_400(pending, alice, payload):
    before = snapshot(pending)
    body = {**payload, "digest": pending.action_digest}
    error = error_of(token_client(alice).post(f"/api/v1/approvals/{pending.pk}/reject", body, format="json"),
                     400, "invalid_input")
    assert "comment" in error["details"]["fields"], error
    assert snapshot(pending) == before
    assert before[:3] == ("pending", None, "AWAITING_HITL")


@pytest.mark.parametrize("groups", [("agents",), ("agents", "approvers"), ()],
                         ids=["agent", "agent-in-approvers", "no-group"])
def test_an_agents_token_gets_403_on_every_endpoint(tenant, pending, groups):
    agent_api = token_client(make_user("bot", tenant, groups=groups))
    before = snapshot(pending)
    for method, url, payload in (
        ("get", "/api/v1/approvals", None),
        ("get", f"/api/v1/approvals/{pending.pk}", None),
        ("post", f"/api/v1/approvals/{pending.pk}/approve", {"digest": pending.action_digest, "comment": "self-approved"}),
        ("post", f"/api/v1/approvals/{pending.pk}/reject", {"digest": pending.action_digest, "comment": "self-rejected"}),
    ):
        response = getattr(agent_api, method)(url, payload, format="json") if payload else agent_api.get(url)
        error_of(response, 403, "denied")
    assert snapshot(pending) == before
    assert not Decision.objects.exists()


def test_the_submitter_may_not_approve_its_own_run(make_run, alice):
    approval = open_approval(submitted_by(waiting_run(make_run), alice))
    before = snapshot(approval)
    error = error_of(token_client(alice).post(f"/api/v1/approvals/{approval.pk}/approve", {"digest": approval.action_digest}, format="json"),
                     403, "denied")
    assert "separation of duties" in error["message"], error
    assert snapshot(approval) == before
    assert not Decision.objects.exists()


def test_a_replayed_approval_on_a_quorum_request_is_a_409(make_run, alice, bob):
    approval = open_approval(waiting_run(make_run), approvals_required=2)
    api = token_client(alice)
    first = api.post(f"/api/v1/approvals/{approval.pk}/approve", {"digest": approval.action_digest}, format="json")
    assert first.status_code == 200, first.content
    assert (first.json()["status"], first.json()["approvals"]) == ("pending", 1)

    before = snapshot(approval)
    error = error_of(api.post(f"/api/v1/approvals/{approval.pk}/approve", {"digest": approval.action_digest}, format="json"), 409, "invalid_input")
    assert "already decided" in error["message"], error
    error_of(api.post(f"/api/v1/approvals/{approval.pk}/reject", {"digest": approval.action_digest, "comment": "changed my mind"}, format="json"),
             409, "invalid_input")
    assert snapshot(approval) == before
    assert Decision.objects.filter(request=approval).count() == 1

    second = token_client(bob).post(f"/api/v1/approvals/{approval.pk}/approve", {"digest": approval.action_digest}, format="json")
    assert (second.status_code, second.json()["status"], second.json()["approvals"]) == (200, "approved", 2)
    assert Run.objects.get(pk=approval.run_id).state == "EXECUTING"


def test_a_second_approval_of_an_approved_request_is_a_409(tenant, pending, alice, bob):
    assert token_client(alice).post(f"/api/v1/approvals/{pending.pk}/approve", {"digest": pending.action_digest}, format="json").status_code == 200
    before = snapshot(pending)
    assert before[0] == "approved"
    error = error_of(token_client(bob).post(f"/api/v1/approvals/{pending.pk}/approve", {"digest": pending.action_digest}, format="json"),
                     409, "invalid_input")
    assert error["details"]["status"] == "approved", error
    error_of(token_client(bob).post(f"/api/v1/approvals/{pending.pk}/reject", {"digest": pending.action_digest, "comment": "too late"},
                                    format="json"), 409, "invalid_input")
    assert snapshot(pending) == before
    assert Decision.objects.filter(request=pending).count() == 1


@pytest.mark.parametrize("verdict", ["approve", "reject"])
def test_a_decision_by_get_is_a_405(pending, alice, verdict):
    before = snapshot(pending)
    error = error_of(token_client(alice).get(f"/api/v1/approvals/{pending.pk}/{verdict}"), 405, "invalid_input")
    assert "GET" in error["message"], error
    assert snapshot(pending) == before


def test_a_session_decision_without_a_csrf_token_is_a_403(pending, alice):
    client = signed_in(alice, APIClient, enforce_csrf_checks=True)
    assert client.get(f"/api/v1/approvals/{pending.pk}").status_code == 200  # a session reads
    before = snapshot(pending)
    for verdict in ("approve", "reject"):
        error = error_of(client.post(f"/api/v1/approvals/{pending.pk}/{verdict}", {"comment": "csrf"},
                                     format="json"), 403, "denied")
        assert "CSRF" in error["message"], error
    assert snapshot(pending) == before
    assert not Decision.objects.exists()

    # The same session with the token it was given decides.
    assert client.get(f"/approvals/{pending.pk}/").status_code == 200
    token = client.cookies["csrftoken"].value
    response = client.post(f"/api/v1/approvals/{pending.pk}/approve", {"digest": pending.action_digest}, format="json", HTTP_X_CSRFTOKEN=token)
    assert (response.status_code, response.json()["status"]) == (200, "approved")


def test_anonymous_api_calls_are_401(pending):
    for url in ("/api/v1/approvals", f"/api/v1/approvals/{pending.pk}"):
        error_of(APIClient().get(url), 401, "denied")
    error_of(APIClient().post(f"/api/v1/approvals/{pending.pk}/approve", {"digest": pending.action_digest}, format="json"), 401, "denied")
    assert not Decision.objects.exists()


# --- tenant isolation over a hundred ids -----------------------------------------------


def test_another_tenants_ids_and_missing_ids_are_uniform_404s(make_run, outsider):
    theirs = [open_approval(waiting_run(make_run)).pk for _ in range(100)]
    missing = list(range(max(theirs) + 1000, max(theirs) + 1100))
    assert not ApprovalRequest.objects.filter(pk__in=missing).exists()
    api = token_client(outsider)
    page = signed_in(outsider)

    bodies: dict[str, set[str]] = {"detail": set(), "approve": set(), "reject": set(), "page": set()}
    for request_id in theirs + missing:
        for name, response in (
            ("detail", api.get(f"/api/v1/approvals/{request_id}")),
            ("approve", api.post(f"/api/v1/approvals/{request_id}/approve", {"comment": "x"}, format="json")),
            ("reject", api.post(f"/api/v1/approvals/{request_id}/reject", {"comment": "x"}, format="json")),
        ):
            error_of(response, 404, "not_found")
            bodies[name].add(response.content.decode().replace(f"no approval request {request_id}\"", "<id>"))
        response = page.get(f"/approvals/{request_id}/")
        assert response.status_code == 404, (request_id, response.status_code)
        # The page's masked CSRF token (of the logout form) differs on every render.
        bodies["page"].add(re.sub(r'name="csrfmiddlewaretoken" value="[^"]+"', "csrf",
                                  response.content.decode()))
        response = page.post(f"/approvals/{request_id}/approve", {"comment": "x"})
        assert response.status_code == 404, (request_id, response.status_code)
        response = page.post(f"/approvals/{request_id}/reject", {"comment": "x"})
        assert response.status_code == 404, (request_id, response.status_code)

    # One body per endpoint, whether the id exists in another tenant or nowhere.
    assert {name: len(variants) for name, variants in bodies.items()} == {name: 1 for name in bodies}, bodies
    assert Decision.objects.count() == 0
    assert set(ApprovalRequest.objects.values_list("status", flat=True)) == {"pending"}
    assert set(Run.objects.filter(approval_requests__pk__in=theirs).values_list("state", flat=True)) == {
        "AWAITING_HITL"}
    assert api.get("/api/v1/approvals?status=pending").json() == []


# --- pages: the inbox -------------------------------------------------------------------------


def inbox_row(html: str, approval: ApprovalRequest) -> str:
    match = re.search(rf'<tr id="approval-{approval.pk}" data-status="(\w+)">(.*?)</tr>', html, re.S)
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


# --- admin --------------------------------------------------------------------------------------


def superuser(username: str, tenant) -> User:
    user = make_user(username, tenant, groups=("approvers",))
    User.objects.filter(pk=user.pk).update(is_staff=True, is_superuser=True)
    user.refresh_from_db()
    return user


CHANGELIST = "/admin/approvals/approvalrequest/"


def admin_decide(client, action: str, approvals: list, comment: str = ""):
    """An admin action as an operator takes it: the action shows the
    requests with the digest of each (hidden fields), and its form decides."""
    selected = {"action": action, "_selected_action": [approval.pk for approval in approvals]}
    confirmation = client.post(CHANGELIST, selected)
    assert confirmation.status_code == 200
    html = confirmation.content.decode()
    digests = dict(re.findall(r'name="(digest-\d+)" value="([0-9a-f]{64})"', html))
    assert set(digests) == {f"digest-{approval.pk}" for approval in approvals}, html
    return client.post(CHANGELIST, {**selected, **digests, "confirmed": "yes", "comment": comment}, follow=True)


def test_the_admin_action_refuses_the_submitter(tenant, make_run):
    root = superuser("root", tenant)
    approval = open_approval(submitted_by(waiting_run(make_run), root))
    before = snapshot(approval)
    response = admin_decide(signed_in(root), "approve_selected", [approval])
    assert response.status_code == 200
    errors = [str(message) for message in response.context["messages"] if message.level_tag == "error"]
    assert len(errors) == 1 and f"request {approval.pk}" in errors[0] and "separation of duties" in errors[0], errors
    assert snapshot(approval) == before
    assert not Decision.objects.exists()


def test_the_admin_action_approves_for_an_approver_of_the_tenant(tenant, make_run):
    root = superuser("root", tenant)
    approval = open_approval(waiting_run(make_run))
    response = admin_decide(signed_in(root), "approve_selected", [approval])
    assert response.status_code == 200
    assert f"request {approval.pk}: approved" in messages_of(response)
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.APPROVED
    assert Run.objects.get(pk=approval.run_id).state == "EXECUTING"
    assert list(Decision.objects.values_list("decider__username", "decision")) == [("root", "approve")]


def test_the_admin_action_refuses_a_superuser_of_another_tenant(other_tenant, pending):
    root = superuser("globex-root", other_tenant)
    before = snapshot(pending)
    response = admin_decide(signed_in(root), "approve_selected", [pending])
    assert response.status_code == 200
    errors = [str(message) for message in response.context["messages"] if message.level_tag == "error"]
    assert errors == [f"request {pending.pk}: this request belongs to another tenant"], errors
    assert snapshot(pending) == before
    assert not Decision.objects.exists()


def test_the_admin_action_shows_what_it_decides_and_refuses_a_stale_view(tenant, make_run):
    root = superuser("root", tenant)
    approval = open_approval(waiting_run(make_run))
    client = signed_in(root)
    selected = {"action": "approve_selected", "_selected_action": [approval.pk]}
    confirmation = client.post(CHANGELIST, selected).content.decode()
    assert approval.action_digest in confirmation and not Decision.objects.exists()  # nothing decided yet
    seen = re.search(r'name="digest-\d+" value="([0-9a-f]{64})"', confirmation).group(1)
    ApprovalRequest.objects.filter(pk=approval.pk).update(action_digest="0" * 64)  # the plan changed meanwhile
    response = client.post(CHANGELIST, {**selected, f"digest-{approval.pk}": seen, "confirmed": "yes"}, follow=True)
    errors = [str(message) for message in response.context["messages"] if message.level_tag == "error"]
    assert errors == [f"request {approval.pk}: the plan changed since you opened it: reload"], errors
    assert not Decision.objects.exists()
    assert AuditLog.objects.filter(event="approval_stale_view", run_id=approval.run_id).count() == 1


def test_an_admin_reject_needs_a_reason(tenant, make_run):
    approval = open_approval(waiting_run(make_run))
    response = admin_decide(signed_in(superuser("root", tenant)), "reject_selected", [approval])
    assert messages_of(response) == [f"request {approval.pk}: A rejection needs a reason."]
    assert not Decision.objects.exists()


def test_approval_requests_cannot_be_added_changed_or_deleted_in_the_admin(tenant, pending):
    client = signed_in(superuser("root", tenant))
    assert client.get(f"{CHANGELIST}add/").status_code == 403
    assert client.post(f"{CHANGELIST}add/", {"status": "approved"}).status_code == 403
    assert client.get(f"{CHANGELIST}{pending.pk}/delete/").status_code == 403
    assert client.post(f"{CHANGELIST}{pending.pk}/delete/", {"post": "yes"}).status_code == 403
    assert client.post(f"{CHANGELIST}{pending.pk}/change/", {"status": "approved"}).status_code == 403
    response = client.get(f"{CHANGELIST}{pending.pk}/change/")
    assert response.status_code == 200  # read-only
    assert 'name="_save"' not in response.content.decode()
    listing = client.get(CHANGELIST)
    choices = [value for value, _ in listing.context["action_form"].fields["action"].choices if value]
    assert sorted(choices) == ["approve_selected", "reject_selected"]
    client.post(CHANGELIST, {"action": "delete_selected", "_selected_action": [pending.pk], "post": "yes"})
    assert snapshot(pending)[:3] == ("pending", None, "AWAITING_HITL")
    assert ApprovalRequest.objects.filter(pk=pending.pk).exists()


# --- OpenAPI -------------------------------------------------------------------------------------


def test_the_openapi_schema_documents_the_approvals_paths(alice):
    response = signed_in(alice).get("/api/v1/schema/?format=json")
    assert response.status_code == 200, response.content[:500]
    paths = json.loads(response.content)["paths"]
    documented = {(path, method) for path, operations in paths.items() if path.startswith("/api/v1/approvals")
                  for method in operations if method in ("get", "post", "put", "patch", "delete")}
    assert documented == {
        ("/api/v1/approvals", "get"),
        ("/api/v1/approvals/{request_id}", "get"),
        ("/api/v1/approvals/{request_id}/approve", "post"),
        ("/api/v1/approvals/{request_id}/reject", "post"),
    }
    status = next(param for param in paths["/api/v1/approvals"]["get"]["parameters"] if param["name"] == "status")
    assert set(status["schema"]["enum"]) == {*ApprovalStatus.values, "decided"}
    for verdict in ("approve", "reject"):
        assert "requestBody" in paths[f"/api/v1/approvals/{{request_id}}/{verdict}"]["post"]


def test_the_schema_documents_the_reject_body_without_edits(alice):
    schema = signed_in(alice).get("/api/v1/schema/?format=json").json()

    def body_properties(path: str) -> set[str]:
        ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        return set(schema["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"])

    assert "edits" in body_properties("/api/v1/approvals/{request_id}/approve")
    assert body_properties("/api/v1/approvals/{request_id}/reject") == {"comment", "digest"}


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
