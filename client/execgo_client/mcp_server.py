"""An MCP server (the official ``mcp`` SDK's MCPServer) exposing ExecGo to
agents: submit, read, wait for and cancel runs, evaluate plans, list
approvals. A run that needs a human is reported as "awaiting human approval"
with the approval page's URL instead of blocking the agent.

Over stdio the server is its host's child and nobody else can reach it. Over
streamable HTTP anyone who can connect could use the ExecGo token it holds,
so every request must carry ``Authorization: Bearer <token>`` with the token
the server was started with (the SDK's bearer authentication, fed by
``SharedTokenVerifier``); it does not start without one."""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Annotated, Any, Literal

from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import BaseModel, ConfigDict, Field

from execgo_client.client import VERSION, ExecGo, ExecGoError, Run

INSTRUCTIONS = """\
ExecGo runs plans of tool calls (shell commands, http requests, file operations) under an audited policy.
Submit a plan with submit_run; it waits a little and reports the run's state. A run the policy rates high
waits for a person: the result says "awaiting human approval" with the approval page's URL; tell the user,
then call wait_run later. Use evaluate_plan to see the policy's verdict without running anything."""
MAX_WAIT_S = 600.0
ApprovalStatus = Literal["pending", "approved", "rejected", "expired", "cancelled", "voided", "decided", "all"]
OUTPUT_TAIL_CHARS = 2000
MIN_HTTP_TOKEN_CHARS = 16


class PlanStep(BaseModel):
    """One tool call of a plan."""

    model_config = ConfigDict(extra="allow")

    id: str = Field(description="unique within the plan; depends_on refers to it")
    tool: str = Field(description='"shell", "http" or "file"')
    params: dict[str, Any] = Field(default_factory=dict, description=(
        'shell: {"argv": [...]} or {"script": "..."}, optional cwd, env, stdin; '
        'http: {"method", "url", "headers"?, "body"?, "follow_redirects"?}; file: {"op": "read"|"write"|"list", "path", "content"?}'))
    depends_on: list[str] | None = Field(default=None, description="ids of steps that must succeed first")
    timeout_s: int | None = Field(default=None, description="the step's timeout in seconds")
    retries: int | None = Field(default=None, description="retries on retryable errors")
    sandbox: dict[str, Any] | None = Field(default=None, description='{"profile", "mode", "limits"}')


class Plan(BaseModel):
    """A plan: steps run as a DAG (independent steps in parallel)."""

    model_config = ConfigDict(extra="allow")

    steps: list[PlanStep] = Field(min_length=1)


def _plan_json(plan: Plan) -> dict[str, Any]:
    return plan.model_dump(mode="json", exclude_none=True)


def run_summary(client: ExecGo, run: Run) -> dict[str, Any]:
    """What an agent needs of a run: its state, every step's status, exit
    code, output tail and error."""
    steps = []
    for step in run.steps:
        result = step.get("result") or {}
        output = result.get("output") or {}
        entry: dict[str, Any] = {"id": step.get("id"), "tool": step.get("tool"), "status": step.get("status")}
        for key in ("exit_code", "status_code"):
            if key in output:
                entry[key] = output[key]
        for key in ("stdout", "body", "content"):
            if isinstance(output.get(key), str) and output[key]:
                entry[key] = output[key][-OUTPUT_TAIL_CHARS:]
        if result.get("error"):
            entry["error"] = result["error"]
        steps.append(entry)
    summary: dict[str, Any] = {"id": run.id, "title": run.title, "state": run.state,
                               "closing_cause": run.closing_cause, "steps": steps}
    if run.needs_human and run.approval_page:
        summary["approval_page"] = client.url(run.approval_page)
    return summary


def describe(client: ExecGo, run: Run) -> str:
    """One line an agent acts on, then the run as JSON."""
    if run.needs_human:
        page = client.url(run.approval_page) if run.approval_page else "(no approval page given)"
        head = (f"run {run.id} is awaiting human approval: {page} - a person in the approvers group decides "
                f"there; call wait_run({run.id}) later to see the outcome")
    elif run.final:
        head = f"run {run.id} is {run.state}" + (f" ({run.closing_cause})" if run.closing_cause else "")
    else:
        head = f"run {run.id} is still {run.state}; call wait_run({run.id}) to wait for it"
    return head + "\n" + json.dumps(run_summary(client, run), indent=2, default=str)


def _tool_error(exc: ExecGoError) -> ToolError:
    return ToolError(json.dumps(exc.envelope, default=str))


class SharedTokenVerifier:
    """The SDK's ``TokenVerifier`` for one shared token. Both sides are
    hashed before the constant-time comparison, so neither the token's length
    nor a non-ASCII byte in what was presented changes how it is compared."""

    def __init__(self, token: str) -> None:
        self._digest = hashlib.sha256(token.encode()).digest()

    async def verify_token(self, token: str) -> AccessToken | None:
        presented = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        if not hmac.compare_digest(presented, self._digest):
            return None
        return AccessToken(token="", client_id="execgo-mcp", scopes=[])  # the token itself is kept nowhere


def build_server(client: ExecGo, *, http_token: str | None = None) -> MCPServer:
    """The server with every tool; ``http_token``: the bearer token every
    HTTP request must present."""
    server = MCPServer("execgo", instructions=INSTRUCTIONS, version=VERSION, log_level="WARNING",
                       **_http_auth(client, http_token))
    _add_run_tools(server, client)
    _add_review_tools(server, client)
    return server


def _http_auth(client: ExecGo, http_token: str | None) -> dict[str, Any]:
    """MCPServer's authentication arguments: none over stdio, the shared token over HTTP."""
    if http_token is None:
        return {}
    # The SDK's settings name an OAuth issuer; this server is its own:
    # a shared token, no authorization server and no metadata route.
    return {"auth": AuthSettings(issuer_url=client.base_url, resource_server_url=None),
            "token_verifier": SharedTokenVerifier(http_token)}


def _add_run_tools(server: MCPServer, client: ExecGo) -> None:
    """The tools that act on runs: submit, get, wait for and cancel one. Each
    describes the run it ends with, so an agent always learns where it stands."""

    @server.tool()
    def submit_run(
        plan: Plan,
        title: Annotated[str, Field(max_length=200, description="a short title for people")] = "",
        wait_s: Annotated[float, Field(ge=0, le=MAX_WAIT_S, description=(
            "seconds to wait for the run to end or to need a human (0: return at once)"))] = 30.0,
    ) -> str:
        """Submit a plan as a new run and wait up to wait_s seconds for it to end.
        A run that needs a person's approval returns "awaiting human approval" with the page's URL."""
        try:
            run = client.submit(_plan_json(plan), title=title)
            if wait_s > 0 and not (run.final or run.needs_human):
                run = client.wait(run.id, until="any", timeout=wait_s)
        except ExecGoError as exc:
            raise _tool_error(exc) from None
        return describe(client, run)

    @server.tool()
    def get_run(run_id: Annotated[int, Field(ge=1, description="the run's id")]) -> str:
        """A run's state, steps, exit codes, output tails and errors."""
        try:
            return describe(client, client.get(run_id))
        except ExecGoError as exc:
            raise _tool_error(exc) from None

    @server.tool()
    def wait_run(
        run_id: Annotated[int, Field(ge=1, description="the run's id")],
        timeout_s: Annotated[float, Field(ge=0, le=MAX_WAIT_S, description="seconds to wait at most")] = 30.0,
    ) -> str:
        """Wait until a run is final (or needs a human: then "awaiting human approval" and the page's URL)."""
        try:
            return describe(client, client.wait(run_id, until="any", timeout=timeout_s))
        except ExecGoError as exc:
            raise _tool_error(exc) from None

    @server.tool()
    def cancel_run(run_id: Annotated[int, Field(ge=1, description="the run's id")]) -> str:
        """Ask for a run to be cancelled; it closes CLOSED_CANCELLED at its next state with a cancel edge."""
        try:
            run = client.cancel(run_id)
        except ExecGoError as exc:
            raise _tool_error(exc) from None
        return f"cancel of run {run.id} requested (state {run.state})\n" + json.dumps(
            run_summary(client, run), indent=2, default=str)


def _add_review_tools(server: MCPServer, client: ExecGo) -> None:
    """The tools that read what the policy and the approvers decide, without
    starting anything: a plan's verdict, the tenant's approval requests."""

    @server.tool()
    def evaluate_plan(plan: Plan) -> str:
        """The policy's verdict on a plan without running it: risk (low, medium, high, deny), whether
        a human must approve it, whether it would be rejected, and each step's risk and reasons."""
        try:
            evaluation = client.evaluate(_plan_json(plan))
        except ExecGoError as exc:
            raise _tool_error(exc) from None
        verdict = ("would be rejected" if evaluation.rejected else "needs human approval"
                   if evaluation.needs_human else "would run unattended")
        return f"risk {evaluation.risk}: {verdict}\n" + json.dumps(evaluation.raw, indent=2, default=str)

    @server.tool()
    def list_approvals(
        status: Annotated[ApprovalStatus, Field(description="which requests; decided: any decision, all: every one")
                          ] = "pending",
    ) -> str:
        """Approval requests of the tenant (people in the approvers group only: an agent's token is refused)."""
        try:
            approvals = client.approvals(None if status == "all" else status)
        except ExecGoError as exc:
            raise _tool_error(exc) from None
        return json.dumps([{**approval.raw, "page_url": client.url(approval.page_url) if approval.page_url else ""}
                           for approval in approvals], indent=2, default=str)


def serve(client: ExecGo, *, http: bool = False, host: str = "127.0.0.1", port: int = 8765,
          http_token: str | None = None) -> None:
    """Serve over stdio (the default), or streamable HTTP at http://host:port/mcp
    to callers presenting ``Authorization: Bearer <http_token>``."""
    if http:
        if not http_token or len(http_token) < MIN_HTTP_TOKEN_CHARS:
            raise ValueError(f"streamable HTTP needs a token of at least {MIN_HTTP_TOKEN_CHARS} characters")
        build_server(client, http_token=http_token).run("streamable-http", host=host, port=port)
    else:
        build_server(client).run("stdio")
