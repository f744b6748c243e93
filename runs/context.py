"""PREPARING: assemble the run context within its size budget.

The context holds the tool schemas, the agent's long-term memory in this
tenant (newest first) and the history of the job. Over budget, the oldest
memories are dropped first; still over, the run fails. A row of another
tenant reaching the context fails the run with ``denied``.
"""

import json
from dataclasses import dataclass

from django.conf import settings

from runs.errors import ErrorCode, ExecGoError
from runs.memory import memories_for
from runs.models import Run
from runs.plan_schema import KNOWN_TOOLS

TOOL_SCHEMAS = {
    "shell": {"params": {"argv": "list[str]", "script": "str", "cwd": "str?", "env": "dict?", "stdin": "str?"}},
    "http": {"params": {"method": "str", "url": "str", "headers": "dict?", "body": "str?", "timeout_s": "float?", "follow_redirects": "int?"}},
    "file": {"params": {"op": "read|write|list", "path": "str", "content": "str?"}},
}


@dataclass
class Assembled:
    context: dict
    trace: dict


def _size(context: dict) -> int:
    return len(json.dumps(context, default=str).encode())


def assemble_context(run: Run) -> Assembled:
    budget = settings.EXECGO_CONTEXT_BUDGET_BYTES
    memories = memories_for(run)
    foreign = [m["id"] for m in memories if m["tenant_id"] != run.tenant_id or m["source_tenant_id"] != run.tenant_id]
    if foreign:
        raise ExecGoError(ErrorCode.DENIED, f"cross-tenant memory blocked: entries {foreign}", source="store",
                          details={"memory_ids": foreign, "tenant": run.tenant_id})
    history = list(
        Run.objects.filter(job_id=run.job_id, tenant_id=run.tenant_id, pk__lt=run.pk)
        .order_by("pk").values("id", "state", "closing_cause")
    )
    context = {
        "tools": {name: TOOL_SCHEMAS[name] for name in KNOWN_TOOLS},
        "memories": [{"id": m["id"], "run": m["run_id"], "summary": m["summary"], "data": m["data"]}
                     for m in memories],
        "job_history": history,
    }
    dropped = []
    size = _size(context)
    while size > budget and context["memories"]:
        dropped.append(context["memories"].pop()["id"])  # newest first, so pop() drops the oldest
        size = _size(context)
    trace = {"recalled": len(memories), "kept": len(context["memories"]), "dropped": dropped,
             "history": len(history), "bytes": size, "budget_bytes": budget}
    if size > budget:
        raise ExecGoError(ErrorCode.INVALID_INPUT, f"context of {size} bytes is over the budget of {budget} bytes "
                          "even without memories", source="scheduler", details=trace)
    return Assembled(context, trace)
