"""What the egress guard and the out-of-process request cost one http step.

Run: .venv/bin/python bench/bench_http_egress.py [iterations]

Against a server on 127.0.0.2 (allow-listed for the bench), prints median
and p95 wall time per request for
  - in-process:  urllib in this process, as http steps ran before
  - guard:       egress.check_destination alone (literal address)
  - process:     runtime.executor.execute of an http step, helper as the
                 step's uid (the ``process`` profile)
  - sandbox:     the same with the helper inside bubblewrap
                 (``linux_sandbox``)
These reach an allow-listed server, so the request is sent from the host's
network. A public destination's request is sent from a network namespace
of its own behind pasta; as nothing public may be reached from here, that
cost is measured on a step whose destination the bench passes as public
while it is a closed port on 127.0.0.1 (refused where it is sent from):
  - process refused / sandbox refused: sent from the host's network
  - process pasta / sandbox pasta:     sent from pasta's namespace
Uses a throw-away data directory unless EXECGO_DATA_DIR is set.
"""

import http.server
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
SCRATCH = None
if "EXECGO_DATA_DIR" not in os.environ:
    SCRATCH = tempfile.mkdtemp(prefix="execgo-bench-")
    os.environ["EXECGO_DATA_DIR"] = SCRATCH
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", "execgo-bench-only-" + "0123456789abcdef" * 3)
os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
os.environ["EXECGO_HTTP_ALLOWED_NETWORKS"] = "127.0.0.2/32"

import django  # noqa: E402

django.setup()

from runtime import egress, executor, layout  # noqa: E402
from runtime.plan_resolver import resolve_plan  # noqa: E402


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"hello")


def figures(name, samples):
    samples = sorted(samples)
    p95 = samples[min(len(samples) - 1, int(len(samples) * 0.95))]
    print(f"{name:16s} median {statistics.median(samples) * 1000:7.2f} ms   p95 {p95 * 1000:7.2f} ms")
    return statistics.median(samples)


def main():
    iterations = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    server = http.server.ThreadingHTTPServer(("127.0.0.2", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.2:{server.server_address[1]}/"
    timings = {}

    def measure(name, once):
        once()  # warm up
        samples = []
        for _ in range(iterations):
            started = time.perf_counter()
            once()
            samples.append(time.perf_counter() - started)
        timings[name] = figures(name, samples)

    measure("in-process", lambda: urllib.request.urlopen(url, timeout=5).read())
    measure("guard", lambda: egress.check_destination("127.0.0.2", 80, timeout_s=1))
    for profile in ("process", "linux_sandbox"):
        plan = resolve_plan({"profile": profile}, mode="adaptive")

        def step():
            handle = f"bench-{uuid.uuid4().hex[:12]}"
            result = executor.execute(handle, tool="http", params={"url": url}, timeout_s=5, attempt=1, plan=plan)
            assert result["status"] == "success", result["error"]
            shutil.rmtree(layout.task_dir(handle), ignore_errors=True)

        measure("sandbox" if profile == "linux_sandbox" else "process", step)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: a refused connect, and no one else takes the port
    port = closed.getsockname()[1]
    check = egress.check_destination
    for profile in ("process", "linux_sandbox"):
        plan = resolve_plan({"profile": profile}, mode="adaptive")
        name = "sandbox" if profile == "linux_sandbox" else "process"
        for network, public in (("refused", False), ("pasta", True)):
            # allow-listed: the host's network; "public": pasta's namespace.
            egress.check_destination = (lambda host, port, public=public, **kw: egress.Destination(
                host=host, address="127.0.0.1", port=port, allow_listed=not public,
                internal_class=None if public else "loopback"))

            def refused(network=network, plan=plan):
                handle = f"bench-{uuid.uuid4().hex[:12]}"
                result = executor.execute(handle, tool="http", params={"url": f"http://bench.test:{port}/"},
                                          timeout_s=5, attempt=1, plan=plan)
                assert result["error"]["code"] == "external_failure", result["error"]
                assert result["details"]["request_network"] == ("pasta" if network == "pasta" else "host")
                shutil.rmtree(layout.task_dir(handle), ignore_errors=True)

            measure(f"{name} {network}", refused)
    egress.check_destination = check
    closed.close()
    for name in ("process", "sandbox"):
        print(f"{name} costs {(timings[name] - timings['in-process']) * 1000:.1f} ms over in-process (median)")
        print(f"{name}: pasta's namespace adds {(timings[f'{name} pasta'] - timings[f'{name} refused']) * 1000:.1f} ms"
              f" (median)")
    server.shutdown()
    if SCRATCH:
        shutil.rmtree(SCRATCH, ignore_errors=True)


if __name__ == "__main__":
    main()
