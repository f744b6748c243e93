"""Notifications delivered for real: a real worker sends them through an
SMTP server this test starts on loopback (aiosmtpd) and to a chat receiver
on loopback (the operator's chat host list names it), after the request's
transaction commits. The right people get the right messages, each with a
link of their own, and a link decides through the pages. A receiver that
fails at first is tried again, and the outcome of each message is kept."""

import json
import re
import threading
import time
from email import message_from_bytes
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from aiosmtpd.controller import Controller

from approvals.models import ApprovalRequest, Notification, NotificationSettings
from runs.models import Run
from tests.approvals.interfaces_helpers import signed_in
from tests.conftest import (
    WorkerProcess,
    free_port,
    log_tails,
    make_person,
    token_client,
    wait_for_run,
    wait_until,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("echo_pip_install_is_high")]

PLAN = {"steps": [{"id": "install", "tool": "shell", "params": {"script": "echo pip install --dry-run nothing"}}]}
LINK = re.compile(r"Decide: http://testserver(/approvals/link/[^/\s]+/)")


class Inbox:
    """aiosmtpd's handler: every message received, with when."""

    def __init__(self):
        self.messages: list[tuple[float, object]] = []

    async def handle_DATA(self, server, session, envelope):
        self.messages.append((time.time(), message_from_bytes(envelope.content)))
        return "250 OK"


class ChatReceiver:
    """An incoming webhook on loopback: answers 500 to the first ``fail_first`` posts, then 200."""

    def __init__(self, fail_first: int = 1):
        self.posts: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.posts.append(body)
                status = 500 if len(receiver.posts) <= fail_first else 200
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks/T1"



def test_a_request_s_approvers_get_their_messages_by_smtp_and_chat_and_a_link_decides(seeded_policy, tenant, agent):
    ann, ben, cat = (make_person(name, tenant, "approvers") for name in ("ann", "ben", "cat"))
    make_person("bot", tenant, "approvers", "agents")
    chat = ChatReceiver(fail_first=1)
    NotificationSettings.objects.create(user=cat, email=False, chat_url=chat.url, chat_format="slack")
    inbox, port = Inbox(), free_port()
    smtp = Controller(inbox, hostname="127.0.0.1", port=port)
    smtp.start()
    worker = WorkerProcess(hostname="notify", env={
        "EMAIL_BACKEND": "django.core.mail.backends.smtp.EmailBackend", "EMAIL_HOST": "127.0.0.1",
        "EMAIL_PORT": str(port), "EXECGO_PUBLIC_URL": "http://testserver", "EXECGO_CHAT_WEBHOOK_HOSTS": "127.0.0.1",
        "EXECGO_NOTIFY_RETRY_BASE_S": "0.5"}).start()
    try:
        response = token_client(agent).post("/api/v1/runs", {"title": "needs a human", "plan": PLAN}, format="json")
        run_id = response.json()["id"]
        wait_until(lambda: len(inbox.messages) == 2, timeout=60, what="two e-mails")
        wait_until(lambda: Notification.objects.filter(channel="chat", status="sent").exists(), timeout=60,
                   what="the chat message, after one failed attempt")
        request = ApprovalRequest.objects.get(run_id=run_id)
        mails = {message["To"]: message for _at, message in inbox.messages}
        assert sorted(mails) == ["ann@example.com", "ben@example.com"]
        for message in mails.values():
            assert message["Subject"] == f"[ExecGo] Approval needed: run #{run_id} \"needs a human\" (high)"
            risk_line = next(line for line in message.get_payload().splitlines() if line.startswith("Risk: "))
            assert risk_line.startswith("Risk: high: ") and "stands for a package install in tests" in risk_line
        links = {to: LINK.search(message.get_payload()).group(1) for to, message in mails.items()}
        assert links["ann@example.com"] != links["ben@example.com"]
        chat_row = Notification.objects.get(channel="chat")
        assert (chat_row.recipient, chat_row.attempts, chat_row.last_error) == (cat, 2, "")
        assert len(chat.posts) == 2 and chat.posts[-1]["text"].startswith("*[ExecGo] Approval needed")
        assert LINK.search(chat.posts[-1]["text"]) is not None

        page = signed_in(ben).get(links["ben@example.com"])
        assert page.status_code == 200 and ApprovalRequest.objects.get(pk=request.pk).status == "pending"
        assert signed_in(ben).post(links["ben@example.com"], {"verdict": "approve"}).status_code == 302
        run = wait_for_run(run_id, timeout=60)
        assert run.state == "SUCCEEDED"
        wait_until(lambda: Notification.objects.filter(kind="decided", status="sent").count() == 3, timeout=60,
                   what="the outcome told to the three")
    except (AssertionError, pytest.fail.Exception) as exc:
        raise AssertionError(f"{exc}{log_tails(worker)}") from exc
    finally:
        worker.stop()
        smtp.stop()
        chat.server.shutdown()
    assert Run.objects.get(pk=run_id).state == "SUCCEEDED"
