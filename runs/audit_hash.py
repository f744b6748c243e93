"""The content an audit row's ``row_hash`` covers and how it is hashed:
shared by the writer (``runs.audit``), the chain check (``runs.invariants``),
the export and migration 0010. ``tools/verify_audit.py`` repeats
``canonical_json`` with the standard library only: change both or neither."""

import hashlib
import json
from datetime import UTC
from typing import Any

GENESIS = "0" * 64  # the prev_hash of a chain's first row
NO_TENANT_CHAIN = 0  # the chain (and head) of rows that name no tenant
CALLER_LANE, INDEPENDENT_LANE = 0, 1  # rows in the caller's transaction / on the audit connection


def json_roundtrip(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` as the database gives it back (tuples are lists, keys are
    strings), so the hash of the row written is the hash of the row read."""
    return json.loads(json.dumps(data, allow_nan=False))


def timestamp(value) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def row_content(row) -> dict[str, Any]:
    """What ``row_hash`` covers: every column of an AuditLog row (or of a
    historical model's) but ``id`` and ``row_hash``."""
    return {
        "tenant": row.tenant_id, "lane": row.chain_lane, "seq": row.chain_seq, "prev_hash": row.prev_hash, "run": row.run_id,
        "event": row.event, "actor": row.actor_id, "caller": row.caller, "forced_by": row.forced_by,
        "from_state": row.from_state, "to_state": row.to_state, "data": row.data,
        "created_at": timestamp(row.created_at),
    }


def _canonical_numbers(value: Any) -> Any:
    # PostgreSQL's jsonb keeps numbers as decimals: 1e16 comes back as the
    # integer 10000000000000000. An integral float is hashed as that integer.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: _canonical_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_canonical_numbers(item) for item in value]
    return value


def canonical_json(content: dict[str, Any]) -> bytes:
    """Sorted keys, no whitespace, UTF-8, integral floats as integers (the
    same function is in tools/verify_audit.py)."""
    return json.dumps(_canonical_numbers(content), sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode()


def row_digest(content: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(content)).hexdigest()
