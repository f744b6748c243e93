#!/usr/bin/env python3
"""Verify an ExecGo audit export offline (standard library only).

    python3 tools/verify_audit.py audit.jsonl [--anchor LANE:SEQ:HASH ...]

``audit.jsonl`` is what ``manage.py execgo_audit_export --tenant T`` wrote:
one JSON object per line, in chain order (a tenant has one chain per
``lane``; lane 0 first). Each line's ``row_hash`` must be the SHA-256 of the
canonical JSON of the line without ``id`` and ``row_hash`` (sorted keys, no
whitespace, UTF-8, integral floats written as integers); its ``prev_hash``
the ``row_hash`` of the line before in its lane (64 zeros for the first);
its ``seq`` one more than that line's. With ``--anchor LANE:SEQ:HASH``
(repeatable; the OK line prints the one to record), the line of that lane and
seq must exist and carry that ``row_hash``: a later, longer export still
passes, while history rewritten up to the anchor, or lines cut off the end,
do not.

Exit 0 and ``OK: …`` when every line holds; exit 1 and ``BROKEN: …`` naming
the first line that does not.
"""

import argparse
import hashlib
import json
import sys

GENESIS = "0" * 64


def canonical_numbers(value):
    # The same rule as runs/audit_hash.py: an integral float is an integer.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: canonical_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [canonical_numbers(item) for item in value]
    return value


def row_digest(content: dict) -> str:
    canonical = json.dumps(canonical_numbers(content), sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                           allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def verify(lines, anchors: dict[tuple[int, int], str] | None = None) -> tuple[bool, str]:
    heads: dict[int, tuple[int, str]] = {}  # lane -> (seq, row_hash) of its last line
    seen: dict[tuple[int, int], str] = {}  # (lane, seq) -> row_hash, for the anchors
    tenant, count = None, 0
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
            row_id, stored = line.pop("id"), line.pop("row_hash")
        except (ValueError, KeyError, AttributeError) as exc:
            return False, f"BROKEN: line {number} is not an audit row ({exc})"
        where = f"line {number} (row {row_id}, seq {line.get('seq')})"
        if count and line.get("tenant") != tenant:
            return False, f"BROKEN: {where} is of tenant {line.get('tenant')}, the export of tenant {tenant}"
        tenant = line.get("tenant")
        lane = line.get("lane")
        if not isinstance(lane, int):
            return False, f"BROKEN: {where} names no lane"
        previous_seq, previous_hash = heads.get(lane, (0, GENESIS))
        if line.get("seq") != previous_seq + 1:
            return False, f"BROKEN: {where}: expected seq {previous_seq + 1} (rows missing or out of order)"
        if line.get("prev_hash") != previous_hash:
            return False, f"BROKEN: {where}: prev_hash is not the row_hash of the line before"
        try:
            computed = row_digest(line)
        except (TypeError, ValueError) as exc:
            return False, f"BROKEN: {where} cannot be hashed ({exc})"
        if computed != stored:
            return False, f"BROKEN: {where}: its content does not match its row_hash (content hashes to {computed})"
        heads[lane] = (line["seq"], stored)
        if (lane, line["seq"]) in (anchors or {}):
            seen[lane, line["seq"]] = stored
        count += 1
    for (lane, seq), expected in sorted((anchors or {}).items()):
        if (lane, seq) not in seen:
            return False, f"BROKEN: lane {lane} ends at seq {heads.get(lane, (0,))[0]}, before the anchor at seq {seq}"
        if seen[lane, seq] != expected:
            return False, f"BROKEN: lane {lane} seq {seq} has row_hash {seen[lane, seq]}, not the anchor's"
    summary = ", ".join(f"lane {lane} head seq {seq} row_hash {last} (--anchor {lane}:{seq}:{last})"
                        for lane, (seq, last) in sorted(heads.items()))
    return True, f"OK: {count} rows of tenant {tenant}; {summary or 'no rows'}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Verify an ExecGo audit export (JSON lines) offline.")
    parser.add_argument("export", help="the file execgo_audit_export wrote ('-' for standard input)")
    parser.add_argument("--anchor", action="append", default=[], metavar="LANE:SEQ:HASH",
                        help="a row_hash recorded earlier: that lane's row at that seq must have it")
    args = parser.parse_args(argv)
    try:
        expected = {(int(lane), int(seq)): digest
                    for lane, seq, digest in (anchor.split(":", 2) for anchor in args.anchor)}
    except ValueError:
        parser.error("--anchor takes LANE:SEQ:HASH, e.g. 0:42:3fa4…")
    stream = sys.stdin if args.export == "-" else open(args.export, encoding="utf-8")
    with stream:
        ok, message = verify(stream, expected)
    print(message)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
