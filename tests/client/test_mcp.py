"""``execgo mcp`` driven by the official SDK's stdio client, as an MCP host
would: the tools, a run to SUCCEEDED, a high-risk run that answers "awaiting
human approval" instead of blocking."""

import asyncio
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from tests.conftest import ROOT, simple_plan

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("echo_pip_install_is_high")]

TOOLS = {"submit_run", "get_run", "wait_run", "cancel_run", "evaluate_plan", "list_approvals"}


def run_in_own_loop(coro):
    """Playwright tests in this process keep an event loop in the main thread."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result(timeout=300)


def text_of(result) -> str:
    return "\n".join(block.text for block in result.content if getattr(block, "type", "") == "text")


def run_of(text: str) -> dict:
    """The run's JSON after the tool's first line."""
    return json.loads(text.split("\n", 1)[1])


async def session_script(env: dict) -> dict:
    seen: dict = {}
    server = StdioServerParameters(command=sys.executable, args=["-m", "execgo_client.cli", "mcp"], env=env,
                                   cwd=str(ROOT))
    async with stdio_client(server) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        seen["tools"] = {tool.name: tool for tool in (await session.list_tools()).tools}

        submitted = await session.call_tool("submit_run", {
            "plan": simple_plan(["echo", "from mcp"]), "title": "mcp", "wait_s": 0})
        seen["submitted"] = (submitted.is_error, text_of(submitted))
        run_id = run_of(text_of(submitted))["id"]
        waited = await session.call_tool("wait_run", {"run_id": run_id, "timeout_s": 120})
        seen["waited"] = (waited.is_error, text_of(waited))
        got = await session.call_tool("get_run", {"run_id": run_id})
        seen["got"] = (got.is_error, text_of(got))

        risky = await session.call_tool("submit_run", {"plan": simple_plan(["echo", "pip", "install", "x"])})
        seen["risky"] = (risky.is_error, text_of(risky))
        risky_id = run_of(text_of(risky))["id"]
        waited = await session.call_tool("wait_run", {"run_id": risky_id, "timeout_s": 5})
        seen["risky_waited"] = (waited.is_error, text_of(waited))
        cancelled = await session.call_tool("cancel_run", {"run_id": risky_id})
        seen["cancelled"] = (cancelled.is_error, text_of(cancelled))

        evaluated = await session.call_tool("evaluate_plan", {"plan": simple_plan(["sudo", "true"])})
        seen["evaluated"] = (evaluated.is_error, text_of(evaluated))
        approvals = await session.call_tool("list_approvals", {})
        seen["approvals"] = (approvals.is_error, text_of(approvals))
        missing = await session.call_tool("get_run", {"run_id": 999999})
        seen["missing"] = (missing.is_error, text_of(missing))
    return seen


def test_mcp_tools_over_stdio(seeded_policy, live_web, celery_worker, client_env):
    seen = run_in_own_loop(session_script(client_env))

    assert set(seen["tools"]) == TOOLS
    plan_schema = seen["tools"]["submit_run"].input_schema
    assert "plan" in plan_schema["required"] and "title" in plan_schema["properties"]
    assert seen["tools"]["wait_run"].input_schema["properties"]["run_id"]["type"] == "integer"

    assert seen["submitted"][0] is False
    is_error, text = seen["waited"]
    assert not is_error and "SUCCEEDED" in text.splitlines()[0]
    assert "from mcp" in run_of(text)["steps"][0]["stdout"]
    assert "SUCCEEDED" in seen["got"][1]

    is_error, text = seen["risky"]
    assert not is_error
    assert "awaiting human approval" in text and f"{live_web.url}/approvals/" in text
    assert run_of(text)["state"] == "AWAITING_HITL"
    assert "awaiting human approval" in seen["risky_waited"][1] and "/approvals/" in seen["risky_waited"][1]
    assert seen["cancelled"][0] is False and "cancel of run" in seen["cancelled"][1]

    is_error, text = seen["evaluated"]
    assert not is_error and text.startswith("risk deny: would be rejected")

    is_error, text = seen["approvals"]
    assert is_error and '"code": "denied"' in text  # an agent's token may not list approvals
    is_error, text = seen["missing"]
    assert is_error and '"code": "not_found"' in text
