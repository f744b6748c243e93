"""``execgo mcp --http`` serves only callers presenting its bearer token: a
real server process on loopback, asked with no token, wrong ones and the
right one (then driven through the SDK's streamable HTTP client to a tool
that reaches the live ExecGo server).

Refusing a caller, and starting or not, are the MCP server's own business:
those tests give it an ExecGo URL where nothing listens, so they show it
decides without asking ExecGo (and need no database)."""

import asyncio
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from tests.client.conftest import CLIENT_DIR
from tests.conftest import ROOT, free_port, simple_plan

MCP_TOKEN = "mcp-shared-secret-0123456789abcdef"
INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "test", "version": "0"}}}
HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def start_mcp(env: dict, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "execgo_client.cli", "mcp", "--http", "--port", str(port),
                                *extra], env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/mcp"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        try:
            httpx.get(url, timeout=2)
            return process, url
        except httpx.TransportError:
            time.sleep(0.1)
    process.kill()
    raise AssertionError(f"the MCP server did not answer: {process.communicate(timeout=10)}")


# An ExecGo that is not there: the discard port, where nothing listens.
OFFLINE_ENV = {**os.environ, "PYTHONPATH": str(CLIENT_DIR), "EXECGO_URL": "http://127.0.0.1:9",
               "EXECGO_TOKEN": "an-agent-token-the-server-never-gets-to-use", "EXECGO_MCP_TOKEN": MCP_TOKEN}


@pytest.fixture(scope="module")
def offline_mcp_url():
    """One MCP server for the module's tests of its bearer check."""
    process, url = start_mcp(OFFLINE_ENV)
    yield url
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture
def mcp_url(client_env):
    """An MCP server in front of the live ExecGo server."""
    process, url = start_mcp({**client_env, "EXECGO_MCP_TOKEN": MCP_TOKEN})
    yield url
    process.terminate()
    process.wait(timeout=30)


def post_initialize(url: str, authorization: str | bytes | None) -> httpx.Response:
    headers = {**HEADERS, **({"Authorization": authorization} if authorization is not None else {})}
    return httpx.post(url, json=INITIALIZE, headers=headers, timeout=10)


@pytest.mark.parametrize("authorization", [
    None, "", "Bearer", f"Bearer {MCP_TOKEN}x", f"Bearer {MCP_TOKEN[:-1]}", f"Token {MCP_TOKEN}",
    f"Basic {MCP_TOKEN}", ("Bearer " + "é" * 20).encode(), b"Bearer " + MCP_TOKEN.encode() + b"\xff", f"Bearer  {MCP_TOKEN}",
])
def test_a_request_without_the_token_is_refused(offline_mcp_url, authorization):
    response = post_initialize(offline_mcp_url, authorization)

    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert "serverInfo" not in response.text


def test_the_right_token_is_served(offline_mcp_url):
    response = post_initialize(offline_mcp_url, f"Bearer {MCP_TOKEN}")

    assert response.status_code == 200, response.text
    assert "serverInfo" in response.text and "execgo" in response.text


async def evaluate_over_http(url: str) -> str:
    async with create_mcp_http_client(headers={"Authorization": f"Bearer {MCP_TOKEN}"}) as http, \
            streamable_http_client(url, http_client=http) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        result = await session.call_tool("evaluate_plan", {"plan": simple_plan(["echo", "pip", "install", "x"])})
        return "\n".join(block.text for block in result.content if getattr(block, "type", "") == "text")


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("echo_pip_install_is_high")
def test_an_mcp_session_with_the_token_reaches_execgo(mcp_url):
    with ThreadPoolExecutor(max_workers=1) as pool:  # an event loop of its own
        text = pool.submit(asyncio.run, evaluate_over_http(mcp_url)).result(timeout=120)

    assert text.startswith("risk high: needs human approval"), text


@pytest.mark.parametrize("token", [None, "", "short"])
def test_http_refuses_to_start_without_a_token(token):
    env = {key: value for key, value in OFFLINE_ENV.items() if key != "EXECGO_MCP_TOKEN"}
    if token is not None:
        env["EXECGO_MCP_TOKEN"] = token
    result = subprocess.run([sys.executable, "-m", "execgo_client.cli", "mcp", "--http", "--port",
                             str(free_port())], env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=60)

    assert result.returncode == 1, result
    assert "EXECGO_MCP_TOKEN" in result.stderr and '"invalid_input"' in result.stderr


def test_token_env_names_the_variable():
    env = {**OFFLINE_ENV, "MY_MCP_SECRET": MCP_TOKEN}
    env.pop("EXECGO_MCP_TOKEN", None)
    process, url = start_mcp(env, "--token-env", "MY_MCP_SECRET")
    try:
        assert post_initialize(url, f"Bearer {MCP_TOKEN}").status_code == 200
        assert post_initialize(url, None).status_code == 401
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_stdio_needs_no_mcp_token():
    env = {key: value for key, value in OFFLINE_ENV.items() if key != "EXECGO_MCP_TOKEN"}
    # stdio with its input closed: the server starts, reads end-of-file and ends cleanly.
    result = subprocess.run([sys.executable, "-m", "execgo_client.cli", "mcp"], env=env, cwd=str(ROOT),
                            input="", capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result
    assert "EXECGO_MCP_TOKEN" not in result.stderr
