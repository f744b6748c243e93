"""The fault tests' workload: a driver that submits runs over HTTP and
records every answer, and a scripted approver that decides what waits on a
person, also over HTTP, as a person in the inbox would.

Kinds of run (``PLANS``): chains of sequential steps, fan-outs (one step,
three in parallel, one after them), long ones (some cancelled while they
run), and ``effect`` runs whose second step is an http POST to the
side-effect recorder (tests/reliability/recorder.py). That POST goes to an
allow-listed internal address, which the policy rates high: every effect
run waits for the approver, who approves most and rejects some.
"""

import threading

import httpx

RUN_TIMEOUT_S = 60
KINDS = ("chain", "fan", "long", "effect")


def shell(step_id: str, argv: list[str], *after: str) -> dict:
    return {"id": step_id, "tool": "shell", "params": {"argv": argv}, "depends_on": list(after)}


def effect(step_id: str, url: str, *after: str) -> dict:
    return {"id": step_id, "tool": "http", "params": {"method": "POST", "url": url, "body": {"step": step_id}},
            "depends_on": list(after)}


def plan_of(kind: str, key: str, recorder) -> list[dict]:
    if kind == "chain":
        return [shell("a", ["sleep", "0.3"]), shell("b", ["true"], "a"), shell("c", ["sleep", "0.3"], "b")]
    if kind == "fan":
        return [shell("a", ["true"]), *(shell(f"m{i}", ["sleep", "0.2"], "a") for i in range(3)),
                shell("z", ["true"], "m0", "m1", "m2")]
    if kind == "long":
        return [shell("a", ["sleep", "4"])]
    return [shell("a", ["true"]), effect("effect", recorder.url(f"{key}/effect"), "a")]


class Driver:
    """Submits the workload, each run with an ``Idempotency-Key`` (a refused
    submit is sent again with its key), and records every answer."""

    def __init__(self, client: httpx.Client, recorder):
        self.client, self.recorder = client, recorder
        self.accepted: dict[str, tuple[int, str]] = {}  # key → (run id, kind)
        self.answers: list[tuple[str, int]] = []
        self.pending: list[str] = []
        self._kinds: dict[str, str] = {}

    def submit(self, key: str) -> None:
        kind = self._kinds.setdefault(key, KINDS[len(self._kinds) % len(KINDS)])
        response = self.client.post("/api/v1/runs", json={
            "title": f"{kind} {key}", "plan": {"steps": plan_of(kind, key, self.recorder)},
            "timeout_s": RUN_TIMEOUT_S}, headers={"Idempotency-Key": key})
        self.answers.append((key, response.status_code))
        if response.status_code in (200, 201):
            self.accepted[key] = (response.json()["id"], kind)
        else:
            assert response.status_code == 503 and response.json()["error"]["retryable"] is True, response.text
            self.pending.append(key)

    def wave(self, prefix: str, count: int) -> None:
        for index in range(count):
            self.submit(f"{prefix}-{index}")

    def retry_refused(self) -> None:
        pending, self.pending = self.pending, []
        for key in pending:
            self.submit(key)

    def cancel_long_runs(self, count: int) -> list[int]:
        cancelled = []
        for run_id, kind in list(self.accepted.values()):
            if kind == "long" and len(cancelled) < count:
                answer = self.client.post(f"/api/v1/runs/{run_id}/cancel", json={"reason": "nemesis"})
                assert answer.status_code in (202, 409), answer.text
                cancelled.append(run_id)
        return cancelled

    @property
    def run_ids(self) -> list[int]:
        return [run_id for run_id, _kind in self.accepted.values()]

    def side_effects(self) -> dict[tuple[int, str], int]:
        """(run id, step id) → what the recorder counted, for every effect step."""
        return {(run_id, "effect"): self.recorder.count(f"{key}/effect")
                for key, (run_id, kind) in self.accepted.items() if kind == "effect"}


class ScriptedApprover(threading.Thread):
    """Polls the approvals inbox (``GET /api/v1/approvals?status=pending``)
    and decides each request on the view it read (its ``action_digest``):
    every ``reject_every``-th request it sees is rejected with a reason, the
    others approved. An answer other than 200 (a 409 stale view, a 503 while
    the broker is down, a transport error) is tried again at the next poll;
    every answer is kept in ``answers``."""

    def __init__(self, client: httpx.Client, *, reject_every: int = 4, poll_s: float = 0.3):
        super().__init__(daemon=True)
        self.client, self.reject_every, self.poll_s = client, reject_every, poll_s
        self.seen: list[int] = []
        self.decided: dict[int, str] = {}  # request id → "approve" | "reject"
        self.answers: list[tuple[int, str, int]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self._poll()
            except httpx.TransportError:
                pass
            self._halt.wait(self.poll_s)

    def _poll(self) -> None:
        response = self.client.get("/api/v1/approvals?status=pending")
        if response.status_code != 200:
            return
        for request in response.json():
            if request["id"] in self.decided:
                continue
            if request["id"] not in self.seen:
                self.seen.append(request["id"])
            verdict = "reject" if self.seen.index(request["id"]) % self.reject_every == self.reject_every - 1 \
                else "approve"
            body = {"digest": request["action_digest"]}
            if verdict == "reject":
                body["comment"] = "not this one"
            answer = self.client.post(f"/api/v1/approvals/{request['id']}/{verdict}", json=body)
            self.answers.append((request["id"], verdict, answer.status_code))
            if answer.status_code == 200:
                self.decided[request["id"]] = verdict

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)
