"""Serve ExecGo on this machine: what ``make run`` runs after migrating.

It bootstraps the demo tenant, starts the ``Procfile`` (web, worker, beat)
under honcho, and once the processes answer prints one block: the URL, how
to sign in, the passwords generated at the first start and the agent's
token. The secrets go to this command's stdout only, never through
``logging``, and only once the processes are up, so the lines the
processes log while starting do not scroll them away.

/metrics and /readyz's details need ``EXECGO_METRICS_TOKEN``: unless the
environment sets one, a token is generated at the first start, kept in the
data dir (``metrics-token``, mode 0600) for the next ones, handed to the
processes and printed in the block.

Ctrl-C (SIGINT to the terminal's process group, or to this process alone)
and SIGTERM are passed to honcho, which sends each process a SIGTERM and
waits for it; this command ends when honcho has.
"""

import io
import os
import re
import secrets as secrets_module
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand
from django.db import connections

from runs.management.commands.execgo_bootstrap import ACCOUNTS

SECRET_LINE = re.compile(r"^(EXECGO_[A-Z_]+)=(\S+)$")


class Command(BaseCommand):
    help = ("Bootstrap the demo tenant, start web + worker + beat from the Procfile (honcho) and print where to "
            "sign in, the first start's passwords and the agent's token once they answer. Ctrl-C stops them all.")

    def add_arguments(self, parser):
        parser.add_argument("--port", type=int, default=int(os.environ.get("EXECGO_PORT") or 8000),
                            help="the web process's port (default: $EXECGO_PORT, else 8000)")
        parser.add_argument("--ready-timeout", type=float, default=90.0,
                            help="seconds to wait for the processes to answer before printing anyway")

    def handle(self, *args, port: int, ready_timeout: float, **options):
        bootstrap = io.StringIO()
        call_command("execgo_bootstrap", stdout=bootstrap)
        secrets = dict(match.groups() for line in bootstrap.getvalue().splitlines()
                       if (match := SECRET_LINE.match(line)))
        connections.close_all()  # nothing of this process holds the database while it waits

        secrets["EXECGO_METRICS_TOKEN"] = metrics_token = settings.EXECGO_METRICS_TOKEN or _kept_metrics_token()
        base = f"http://127.0.0.1:{port}"
        honcho = subprocess.Popen([str(Path(sys.executable).parent / "honcho"), "start"], cwd=settings.BASE_DIR,
                                  env={**os.environ, "EXECGO_PORT": str(port), "EXECGO_METRICS_TOKEN": metrics_token})
        stopping = []

        def stop(signum, _frame):
            # A terminal's Ctrl-C reaches honcho too (one process group); it
            # takes the first of the two and ignores the second.
            if not stopping and honcho.poll() is None:
                stopping.append(signum)
                honcho.send_signal(signal.SIGINT)

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        waiting = _wait_until_ready(base, honcho, timeout=ready_timeout, stopping=stopping)
        if honcho.poll() is None and not stopping:
            # One write: honcho's lines never land inside the block.
            os.write(sys.stdout.fileno(), _banner(base, secrets, waiting).encode())
        return_code = honcho.wait()
        if return_code and not stopping:
            raise SystemExit(return_code)


def _kept_metrics_token() -> str:
    path = Path(settings.DATA_DIR) / "metrics-token"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    token = secrets_module.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(token + "\n")
    return token


def _wait_until_ready(base: str, honcho: subprocess.Popen, *, timeout: float, stopping: list) -> str:
    """Wait for the web process (``/healthz``) and a worker (a ping over the
    broker); return what still does not answer when ``timeout`` ran out, or
    "" once both do. Beat needs no wait: its first tick only comes an
    interval after it started."""
    from execgo.celery import app

    deadline = time.monotonic() + timeout
    waiting = "the web process"
    while time.monotonic() < deadline and honcho.poll() is None and not stopping:
        try:
            if waiting == "the web process":
                with urllib.request.urlopen(f"{base}/healthz", timeout=5):
                    waiting = "a worker"
            if app.control.ping(timeout=1.0, limit=1):
                return ""
        except OSError:
            pass
        time.sleep(0.25)
    return waiting


def _banner(base: str, secrets: dict[str, str], waiting: str) -> str:
    rule = "=" * 72
    lines = [rule, f"ExecGo is up at {base}/" if not waiting else f"ExecGo is starting at {base}/",
             f"  ({waiting} does not answer yet)" if waiting else "",
             f"  Sign in at {base}/accounts/login/ as:"]
    for account in ACCOUNTS:
        if not account.signs_in:
            continue
        password = secrets.get(account.env_var)
        shown = (f"password {password}  (generated at this first start; shown once)" if password else
                 f"the password set at the first start (or ${account.env_var})")
        lines.append(f"    {account.username:<9} {shown}")
    key = secrets.get("EXECGO_AGENT_TOKEN")
    lines += [f"  Agents' API ({base}/api/v1/docs/), with the demo agent's token"
              + (" (shown once: only its digest is kept):" if key else ":"),
              f"    EXECGO_AGENT_TOKEN={key}" if key else
              "    the one shown at the first start (revoke it in the admin and restart for a new one)",
              f"  {base}/metrics and {base}/readyz's details with 'Authorization: Bearer <token>':",
              f"    EXECGO_METRICS_TOKEN={secrets.get('EXECGO_METRICS_TOKEN', '')}",
              "  Ctrl-C stops every process.", rule]
    return "\n".join(line for line in lines if line) + "\n"
