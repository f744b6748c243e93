"""The side-effect recorder: a loopback HTTP server that the fault tests'
http steps call (the workers are given ``EXECGO_HTTP_ALLOWED_NETWORKS``
for its address alone). Each request it answers is one side effect of one
step, named by its path; the history checker compares how many each step
had with the attempts the database says it started."""

import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ADDRESS = "127.0.0.1"


class EffectRecorder:
    """Counts the requests to each path; answers each after ``delay_s``
    (a step takes a moment, as real ones do: long enough for a second
    delivery of it to come while it runs)."""

    def __init__(self, *, delay_s: float = 0.3):
        self.hits: Counter[str] = Counter()
        self.log: list[tuple[float, str, str]] = []  # (when, method, path): every request, in order
        self._lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def _record(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                with recorder._lock:
                    recorder.hits[self.path] += 1
                    recorder.log.append((time.time(), self.command, self.path))
                time.sleep(delay_s)
                body = b'{"recorded": true}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = _record

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer((ADDRESS, 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def network(self) -> str:
        return f"{ADDRESS}/32"

    def url(self, path: str) -> str:
        return f"http://{ADDRESS}:{self.server.server_address[1]}/{path}"

    def count(self, path: str) -> int:
        with self._lock:
            return self.hits[f"/{path}"]

    def __enter__(self) -> "EffectRecorder":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
