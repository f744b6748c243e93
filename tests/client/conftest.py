"""The client against the live server: the shared Daphne server of the web
tests, a real worker, and the agent's API token."""

import os
import sys

import pytest

from tests.conftest import ROOT, make_token
from tests.pages.conftest import _stop_daphne_at_exit, live_web  # noqa: F401

CLIENT_DIR = ROOT / "client"
if str(CLIENT_DIR) not in sys.path:
    sys.path.insert(0, str(CLIENT_DIR))


@pytest.fixture
def agent_token(agent) -> str:
    return make_token(agent)


@pytest.fixture
def client_env(live_web, agent_token) -> dict:  # noqa: F811 (the fixture imported above)
    """The environment of an ``execgo`` process talking to the live server as the agent."""
    return {**os.environ, "PYTHONPATH": str(CLIENT_DIR), "EXECGO_URL": live_web.url, "EXECGO_TOKEN": agent_token}
