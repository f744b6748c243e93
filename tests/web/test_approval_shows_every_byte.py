"""An approval shows every byte that can change what runs: a shell step's
argv as a list, its stdin, env and cwd, an http step's headers (secret
values as their length only) and body, a file step's content, each step's
sandbox; invisible characters escaped. Read off the page in Chromium, and
off GET /api/v1/approvals/{id}. Nothing here runs: the run waits for a human."""

import pytest
from django.utils import timezone

from approvals.models import ApprovalRequest
from runs.models import Step
from runs.policy import evaluate_policy
from tests.conftest import token_client
from tests.web.conftest import PASSWORD, log_in, screenshot

pytestmark = pytest.mark.django_db(transaction=True)

# A bell, an escape sequence and a right-to-left override hidden in what an approver reads.
STDIN = "id\n\x07echo \x1b[2Jcleared\nrm -rf ./build \u202e;txt.exe\n"
BODY = {"order": 7, "note": "ship \u200bnow"}
CONTENT = "line one\nline two\x01\n"  # not NUL: PostgreSQL's JSON cannot hold it (the API refuses it there)
SECRET = "Bearer s3cr3t-value-never-shown"


@pytest.fixture
def waiting(make_run, approver):
    run = make_run("AWAITING_HITL", previous_state="POLICY_CHECK")
    steps = [
        ("feed", "shell", {"argv": ["sh", "-s", "--", "two words"], "stdin": STDIN, "env": {"MODE": "fast"},
                           "cwd": "sub/dir"}, {"profile": "linux_sandbox", "network": "none"}),
        ("call", "http", {"method": "POST", "url": "https://api.example.com/orders",
                          "headers": {"Authorization": SECRET, "Accept": "application/json"}, "body": BODY}, {}),
        ("keep", "file", {"op": "write", "path": "notes.txt", "content": CONTENT}, {}),
    ]
    for position, (step_id, tool, params, sandbox) in enumerate(steps):
        Step.objects.create(run=run, step_id=step_id, position=position, tool=tool, params=params,
                            requested_plan=sandbox, timeout_s=5)
    decision = evaluate_policy(run)
    return ApprovalRequest.open_for(run, {**decision.data, "risk": "high"}, now=timezone.now())


ESCAPED_STDIN = "id\n\\x07echo \\x1b[2Jcleared\nrm -rf ./build \\u202e;txt.exe\n"


def test_the_api_shows_every_byte_escaped(waiting, approver):
    response = token_client(approver).get(f"/api/v1/approvals/{waiting.pk}")
    assert response.status_code == 200
    feed, call, keep = (step["shown"] for step in response.json()["steps"])
    assert feed["argv"] == ["sh", "-s", "--", "two words"]
    assert feed["stdin"]["text"] == ESCAPED_STDIN and feed["stdin"]["escaped"] is True
    assert (feed["env"], feed["cwd"], feed["sandbox"]) == ({"MODE": "fast"}, "sub/dir",
                                                           {"profile": "linux_sandbox", "network": "none"})
    assert call["headers"] == [{"name": "Accept", "value": "application/json"},
                               {"name": "Authorization", "length": len(SECRET), "masked": True}]
    assert "s3cr3t" not in response.content.decode()
    assert '"note": "ship \\u200bnow"' in call["body"]["text"]
    assert keep["content"]["text"] == "line one\nline two\\x01\n"


def test_the_page_shows_every_byte_escaped(page, waiting, approver):
    log_in(page, "alice", PASSWORD)
    page.goto(f"/approvals/{waiting.pk}/")
    feed = page.locator("[data-step=feed]")
    assert feed.locator("ol.argv li").all_inner_texts() == ["sh", "-s", "--", "two words"]
    assert feed.locator("pre[data-field=stdin]").inner_text().rstrip("\n") == ESCAPED_STDIN.rstrip("\n")
    assert feed.locator("[data-field=env]").inner_text() == "MODE=fast"
    assert feed.locator("[data-field=cwd]").inner_text() == "sub/dir"
    assert '"profile": "linux_sandbox"' in feed.locator("[data-field=sandbox]").inner_text()
    call = page.locator("[data-step=call]")
    assert call.locator("[data-field=request-line]").inner_text() == "POST https://api.example.com/orders"
    headers = call.locator("[data-field=headers]").inner_text()
    assert "Authorization: [31 characters, hidden]" in headers and "Accept: application/json" in headers
    assert "\\u200b" in call.locator("pre[data-field=body]").inner_text()
    keep = page.locator("[data-step=keep]")
    assert keep.locator("pre[data-field=content]").inner_text().rstrip("\n") == "line one\nline two\\x01"
    assert "s3cr3t" not in page.content() and "\u202e" not in page.locator("main").inner_text()
    screenshot(page, "approval-every-byte")
