"""An approval shows every byte that can change what runs: a shell step's
argv as a list, its stdin, env and cwd, an http step's headers (secret
values as their length only) and body, a file step's content, each step's
sandbox; invisible characters escaped. Read off the page in Chromium, and
off GET /api/v1/approvals/{id}. Nothing here runs: the run waits for a human."""

import pytest
from django.utils import timezone

from approvals.interface import open_request
from policy.interface import evaluate_policy
from runs.dataplane import bind_rated_plans_of
from runs.models import Step
from tests.conftest import token_client
from tests.pages.conftest import PASSWORD, log_in, screenshot

pytestmark = pytest.mark.django_db(transaction=True)

# A bell, an escape sequence and a right-to-left override hidden in what an approver reads.
STDIN = "id\n\x07echo \x1b[2Jcleared\nrm -rf ./build \u202e;txt.exe\n"
BODY = {"order": 7, "note": "ship \u200bnow"}
CONTENT = "line one\nline two\x01\n"  # not NUL: PostgreSQL's JSON cannot hold it (the API refuses it there)
SECRET = "Bearer s3cr3t-value-never-shown"
# A script long enough to be folded, and a stdin over the review cap (set small here).
LONG_SCRIPT = "".join(f"echo line {index}\n" for index in range(40))
SHOW_MAX_BYTES = 4096
HUGE_STDIN = "x" * (SHOW_MAX_BYTES + 100)


@pytest.fixture
def waiting(make_run, approver, settings):
    settings.EXECGO_APPROVAL_SHOW_MAX_BYTES = SHOW_MAX_BYTES
    run = make_run("AWAITING_HITL", previous_state="POLICY_CHECK")
    steps = [
        ("feed", "shell", {"argv": ["sh", "-s", "--", "two words"], "stdin": STDIN, "env": {"MODE": "fast"},
                           "cwd": "sub/dir"}, {"profile": "linux_sandbox", "network": "none"}),
        ("call", "http", {"method": "POST", "url": "https://api.example.com/orders",
                          "headers": {"Authorization": SECRET, "Accept": "application/json"}, "body": BODY}, {}),
        ("keep", "file", {"op": "write", "path": "notes.txt", "content": CONTENT}, {}),
        ("long", "shell", {"script": LONG_SCRIPT}, {"limits": {"processes": 32, "cpu_seconds": 20}}),
        ("huge", "shell", {"argv": ["wc", "-c"], "stdin": HUGE_STDIN}, {}),
    ]
    for position, (step_id, tool, params, sandbox) in enumerate(steps):
        Step.objects.create(run=run, step_id=step_id, position=position, tool=tool, params=params,
                            requested_plan=sandbox, timeout_s=5)
    decision = evaluate_policy(run)
    bind_rated_plans_of(list(run.steps.all()), decision.data)  # as POLICY_CHECK does
    return open_request(run, {**decision.data, "risk": "high"}, now=timezone.now())


ESCAPED_STDIN = "id\n\\x07echo \\x1b[2Jcleared\nrm -rf ./build \\u202e;txt.exe\n"


def test_the_api_shows_every_byte_escaped(waiting, approver):
    response = token_client(approver).get(f"/api/v1/approvals/{waiting.pk}")
    assert response.status_code == 200
    feed, call, keep, long, huge = (step["shown"] for step in response.json()["steps"])
    assert feed["argv"] == ["sh", "-s", "--", "two words"]
    assert feed["stdin"]["text"] == ESCAPED_STDIN and feed["stdin"]["escaped"] is True
    assert (feed["env"], feed["cwd"], feed["sandbox"]) == ({"MODE": "fast"}, "sub/dir",
                                                           {"profile": "linux_sandbox", "network": "none"})
    assert call["headers"] == [{"name": "Accept", "value": "application/json"},
                               {"name": "Authorization", "length": len(SECRET), "masked": True}]
    assert "s3cr3t" not in response.content.decode()
    assert '"note": "ship \\u200bnow"' in call["body"]["text"]
    assert keep["content"]["text"] == "line one\nline two\\x01\n"
    assert (call["method"], call["url"]) == ("POST", "https://api.example.com/orders")
    assert long["script"] == {"text": LONG_SCRIPT, "bytes": len(LONG_SCRIPT), "lines": 41, "too_large": False,
                              "escaped": False}
    assert long["sandbox"]["limits"] == {"processes": 32, "cpu_seconds": 20}
    assert (long["rated_plan"]["limits"]["processes"], long["rated_plan"]["limits"]["cpu_seconds"]) == (32, 20)
    assert long["rated_plan"]["profile"] == feed["rated_plan"]["profile"]
    # Over the cap: its size and head are shown, never a bare hash, and the step is at least high.
    assert (huge["stdin"]["too_large"], huge["stdin"]["bytes"]) == (True, len(HUGE_STDIN))
    assert huge["stdin"]["text"] == HUGE_STDIN[:SHOW_MAX_BYTES]
    [huge_row] = [step for step in response.json()["steps"] if step["action"]["id"] == "huge"]
    assert huge_row["risk"] in ("high", "deny")
    assert any("too large to review" in reason for reason in huge_row["reasons"])


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
    # A long text is folded, whole behind the fold; one over the cap says so on the fold.
    fold = page.locator("[data-step=long] details[data-field=script]")
    assert "41 lines" in fold.locator("summary").inner_text() and fold.get_attribute("open") is None
    fold.locator("summary").click()
    assert fold.locator("pre").inner_text().rstrip("\n") == LONG_SCRIPT.rstrip("\n")
    assert "32" in page.locator("[data-step=long] [data-field=sandbox]").inner_text()
    too_large = page.locator("[data-step=huge] details[data-field=stdin] summary").inner_text()
    assert f"{len(HUGE_STDIN)} bytes" in too_large and "too large to review" in too_large
    screenshot(page, "approval-every-byte")
