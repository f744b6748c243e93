"""The README's front door, as a newcomer takes it: `make run` on the
embedded default (SQLite + the filesystem broker, no services) serves where
it says, prints one block with the URL and the credentials once its
processes are up, runs the README's curl example to SUCCEEDED, keeps the
periodic tasks off the console, and stops every process it started (the
shim fork server included) on Ctrl-C, with no SIGKILL."""

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
SERVICE_VARIABLES = ("DATABASE_URL", "CELERY_BROKER_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")
BANNER = re.compile(r"^ExecGo is up at (?P<url>http://\S+)/$.*?^    EXECGO_AGENT_TOKEN=(?P<token>\w+)$"
                    r".*?^    EXECGO_METRICS_TOKEN=(?P<metrics_token>[\w-]+)$", re.M | re.S)
FINAL = {"SUCCEEDED", "CLOSED_FAILED", "CLOSED_REJECTED", "CLOSED_CANCELLED"}



def readme_curl_example() -> str:
    """The README's shell block that starts with ``TOKEN=...``."""
    blocks = re.findall(r"^```sh\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    return next(block for block in blocks if block.startswith("TOKEN=..."))


def json_documents(text: str) -> list:
    decoder, documents, at = json.JSONDecoder(), [], 0
    while at < len(text):
        document, at = decoder.raw_decode(text, at)
        documents.append(document)
        while at < len(text) and text[at].isspace():
            at += 1
    return documents


def ours(data_dir: Path) -> list[psutil.Process]:
    """Every process still running that belongs to this `make run`: it names
    the data directory in its command line or its environment."""
    found = []
    for process in psutil.process_iter(["cmdline", "environ"]):
        info = process.info
        if str(data_dir) in " ".join(info["cmdline"] or ()) or (info["environ"] or {}).get(
                "EXECGO_DATA_DIR") == str(data_dir):
            found.append(process)
    return found


@pytest.fixture
def make_run(tmp_path):
    data_dir = tmp_path / "var"
    env = {key: value for key, value in os.environ.items() if key not in SERVICE_VARIABLES}
    env.update(EXECGO_DATA_DIR=str(data_dir), EXECGO_PORT=str(free_port()), PYTHONUNBUFFERED="1",
               # Beat ticks often, so a console that showed periodic tasks would show many.
               EXECGO_SWEEP_INTERVAL_S="1", EXECGO_DEADLINE_SCAN_INTERVAL_S="1", EXECGO_LEDGER_HEAL_INTERVAL_S="1")
    log_path = tmp_path / "make-run.log"
    with open(log_path, "wb") as log:
        # Its own session: the SIGINT below goes to its process group, as a terminal's Ctrl-C does.
        make = subprocess.Popen(["make", "--no-print-directory", "run"], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield make, log_path, data_dir, env["EXECGO_PORT"]
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
        for process in ours(data_dir):
            process.kill()


def wait_for_banner(make, log_path: Path) -> re.Match:
    deadline = time.monotonic() + 240  # a first start migrates a new database
    while not (banner := BANNER.search(log_path.read_text(errors="replace"))):
        if time.monotonic() > deadline or make.poll() is not None:
            pytest.fail(log_path.read_text(errors="replace")[-4000:])
        time.sleep(0.25)
    return banner


def test_make_run_serves_as_the_readme_says_and_stops_cleanly(make_run):
    make, log_path, data_dir, port = make_run
    banner = wait_for_banner(make, log_path)
    base = banner["url"]
    assert base == f"http://127.0.0.1:{port}"
    block = log_path.read_text()[banner.start():]
    assert re.search(r"^    admin +password \S+ ", block, re.M)  # generated at this first start
    assert re.search(r"^    approver +password \S+ ", block, re.M)
    assert f"Sign in at {base}/accounts/login/" in block
    # The block is printed once the processes answer.
    with urllib.request.urlopen(f"{base}/healthz", timeout=10) as response:
        assert json.loads(response.read()) == {"status": "ok"}

    # The README's curl example, as written, but for the token and the port.
    script = readme_curl_example().replace("TOKEN=...", f"TOKEN={banner['token']}", 1)
    script = script.replace("http://127.0.0.1:8000", base)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    created, shown, events = json_documents(done.stdout)
    assert created["id"] == shown["id"] == 1 and created["state"] == "CREATED"
    assert events["events"] and all(event["run_id"] == 1 for event in events["events"])

    run, deadline = shown, time.monotonic() + 90
    while run["state"] not in FINAL:
        if time.monotonic() > deadline:
            pytest.fail(f"run still {run['state']}\n" + log_path.read_text()[-3000:])
        time.sleep(0.2)
        request = urllib.request.Request(f"{base}/api/v1/runs/1", headers={"Authorization": f"Token {banner['token']}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            run = json.loads(response.read())
    assert run["state"] == "SUCCEEDED"
    assert [step["result"]["output"]["stdout"] for step in run["steps"]] == ["hello\n", "42\n"]

    # Ready once beat has run the sweeper (every second here); the checks by
    # name with the metrics token the block printed, and only with it.
    deadline = time.monotonic() + 60
    operator = {"Authorization": f"Bearer {banner['metrics_token']}"}
    while True:
        try:
            ready = json.loads(urllib.request.urlopen(urllib.request.Request(f"{base}/readyz", headers=operator),
                                                      timeout=10).read())
            break
        except urllib.error.HTTPError as not_ready:
            if time.monotonic() > deadline:
                pytest.fail(not_ready.read().decode() + log_path.read_text()[-3000:])
            time.sleep(0.5)
    assert ready["checks"] == dict.fromkeys(("database", "broker", "channel_layer", "workers", "beat"), "ok")
    with urllib.request.urlopen(f"{base}/readyz", timeout=10) as response:
        assert json.loads(response.read()) == {"status": "ready"}
    with urllib.request.urlopen(urllib.request.Request(f"{base}/metrics", headers=operator), timeout=10) as response:
        assert b"# TYPE execgo_runs gauge" in response.read()
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{base}/metrics", timeout=10)
    assert refused.value.code == 401 and b"execgo_" not in refused.value.read()
    assert (data_dir / "metrics-token").read_text().strip() == banner["metrics_token"]

    console = log_path.read_text()
    assert "Sending due task" not in console
    for periodic in ("sweep_zombie_runs", "scan_run_deadlines", "heal_ledgers", "heal_host"):
        assert f"Task runs.tasks.{periodic}[" not in console
    assert "Task runs.tasks.advance_run[" in console  # the run's own tasks still show

    running = [" ".join(process.cmdline()) for process in ours(data_dir)]
    assert any("forkserver_daemon.py" in line for line in running), running  # the run's steps started it
    assert any("celery" in line and " worker" in line for line in running), running
    os.killpg(make.pid, signal.SIGINT)  # Ctrl-C
    interrupted = time.monotonic()
    assert make.wait(timeout=60) is not None
    deadline = time.monotonic() + 10
    while (left := ours(data_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, [process.cmdline() for process in left]
    print(f"make run: every process gone {time.monotonic() - interrupted:.1f} s after Ctrl-C")
    console = log_path.read_text()
    assert "SIGINT received" in console
    # honcho sends SIGKILL only to a process still there 5 s after its SIGTERM.
    assert "SIGKILL" not in console and "signal 9" not in console, console[-3000:]
    assert "ForkPoolWorker" not in console  # no pool process died on the way out
    assert (data_dir / "execgo.sqlite3").exists()
