"""ExecGo's client: the REST API in Python (``ExecGo``), the ``execgo``
command line, and an MCP server for agents (``execgo mcp``)."""

from execgo_client.client import (
    FINAL_STATES,
    NEEDS_HUMAN_STATES,
    VERSION,
    Approval,
    Evaluation,
    Event,
    ExecGo,
    ExecGoError,
    Run,
)

__version__ = VERSION
__all__ = ["FINAL_STATES", "NEEDS_HUMAN_STATES", "Approval", "Evaluation", "Event", "ExecGo", "ExecGoError", "Run",
           "__version__"]
