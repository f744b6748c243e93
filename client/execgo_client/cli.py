"""The ``execgo`` command line: submit, watch and steer runs from a shell."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from execgo_client.client import VERSION, ExecGo, ExecGoError, Run

DEFAULT_URL = "http://127.0.0.1:8000"
EXIT_OK, EXIT_ERROR, EXIT_FAILED, EXIT_REJECTED, EXIT_CANCELLED, EXIT_NEEDS_HUMAN = 0, 1, 2, 3, 4, 5
EXIT_FOR_STATE = {"SUCCEEDED": EXIT_OK, "CLOSED_FAILED": EXIT_FAILED, "CLOSED_REJECTED": EXIT_REJECTED,
                  "CLOSED_CANCELLED": EXIT_CANCELLED, "AWAITING_HITL": EXIT_NEEDS_HUMAN}
APPROVAL_STATUSES = ["pending", "approved", "rejected", "expired", "cancelled", "voided", "decided", "all"]
DONE_STEP_STATUSES = {"success", "failed", "skipped"}
DONE_TASK_EVENTS = {"task_succeeded", "task_failed", "task_cancelled"}

EXIT_CODES_HELP = """\
exit codes:
  0  SUCCEEDED, or the command succeeded (a run still on its way, a cancel accepted, an evaluation)
  1  any error: the error envelope {"error": {code, message, retryable, source, details}} is printed
     to stderr as JSON (also: --wait gave up before the run got anywhere)
  2  the run is CLOSED_FAILED (each failed step's error envelope is printed to stderr)
  3  the run is CLOSED_REJECTED (the policy denied it, a person rejected it, or nobody decided in time)
  4  the run is CLOSED_CANCELLED
  5  the run is AWAITING_HITL: a person must approve it (the approval page's URL is printed)
`submit --wait`, `retry --wait`, `status` and `watch` exit by the run's state.

environment: EXECGO_URL (default http://127.0.0.1:8000), EXECGO_TOKEN (an agent's API token)."""


class UsageError(Exception):
    """Bad command line input, reported as an ``invalid_input`` envelope."""


def _common(defaults: bool) -> argparse.ArgumentParser:
    # Accepted before and after the command; the subcommand's copy must not
    # overwrite a value given before it, hence SUPPRESS there.
    parser = argparse.ArgumentParser(add_help=False)
    default = None if defaults else argparse.SUPPRESS
    parser.add_argument("--url", default=default, help="server URL (default: $EXECGO_URL or %s)" % DEFAULT_URL)
    parser.add_argument("--token", default=default, help="API token (default: $EXECGO_TOKEN)")
    parser.add_argument("--json", action="store_true", default=False if defaults else argparse.SUPPRESS,
                        help="print JSON for machines instead of tables")
    return parser


def build_parser() -> argparse.ArgumentParser:
    common = _common(defaults=False)
    parser = argparse.ArgumentParser(
        prog="execgo", parents=[_common(defaults=True)], epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Submit, watch and steer runs of an ExecGo server.",
    )
    parser.add_argument("--version", action="version", version=f"execgo-client {VERSION}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help_, description=help_, parents=[common], epilog=EXIT_CODES_HELP,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)

    submit = command("submit", "submit a plan (a JSON file, or - for stdin)")
    submit.add_argument("plan", help='{"steps": [...]} (or {"plan": {...}, "title"?, "timeout_s"?, ...})')
    submit.add_argument("--title", default=None)
    submit.add_argument("--wait", action="store_true", help="wait until the run is final or needs a human")
    submit.add_argument("--timeout", type=float, default=600.0, help="seconds --wait waits (default 600)")
    submit.add_argument("--run-timeout", type=int, default=None, help="the run's timeout_s")
    submit.add_argument("--approval-timeout", type=int, default=None, help="the run's approval_timeout_s")
    submit.add_argument("--callback-url", default=None, help="URL the server sends a signed webhook to")
    submit.add_argument("--callback-event", dest="callback_events", action="append", default=None,
                        choices=["final", "awaiting_human"], help="when to call back (repeatable; default: final)")
    submit.add_argument("--idempotency-key", default=None, help="default: a new uuid4")

    status = command("status", "show a run")
    status.add_argument("run", type=int)

    watch = command("watch", "follow a run live: state changes and step output until it is final")
    watch.add_argument("run", type=int)
    watch.add_argument("--last-event-id", default=None, help="resume after this event (default: from the start)")

    cancel = command("cancel", "ask for a run to be cancelled")
    cancel.add_argument("run", type=int)

    retry = command("retry", "start a new run of a final run's plan")
    retry.add_argument("run", type=int)
    retry.add_argument("--wait", action="store_true", help="wait until the new run is final or needs a human")
    retry.add_argument("--timeout", type=float, default=600.0, help="seconds --wait waits (default 600)")

    evaluate = command("evaluate", "rate a plan against the policy without running it")
    evaluate.add_argument("plan", help="a JSON file, or - for stdin")

    approvals = command("approvals", "list approval requests (approvers' tokens only)")
    approvals.add_argument("--status", default="pending", choices=APPROVAL_STATUSES)

    mcp = command("mcp", "serve the MCP tools (stdio, or streamable HTTP with --http)")
    mcp.add_argument("--http", action="store_true", help="streamable HTTP instead of stdio")
    mcp.add_argument("--host", default="127.0.0.1", help="with --http (default 127.0.0.1)")
    mcp.add_argument("--port", type=int, default=8765, help="with --http (default 8765); the path is /mcp")
    mcp.add_argument("--token-env", default="EXECGO_MCP_TOKEN", metavar="NAME",
                     help="with --http: the environment variable holding the token callers must send as "
                          "'Authorization: Bearer <token>' (default EXECGO_MCP_TOKEN); no token, no server")
    return parser


# --- output -------------------------------------------------------------


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=False, default=str))


def _print_error(envelope: dict[str, Any]) -> None:
    print(json.dumps(envelope, sort_keys=False, default=str), file=sys.stderr)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(cell) for cell in headers], *[["" if cell is None else str(cell) for cell in row] for row in rows]]
    widths = [max(len(row[index]) for row in cells) for index in range(len(headers))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells)


def _raising_first(reasons: list) -> list[str]:
    """What raised a step's risk before the baseline that left it low: the
    column is cut, and "baseline low: …" says the least."""
    texts = [str(reason) for reason in reasons]
    return sorted(texts, key=lambda text: text.startswith("baseline low"))


def _short(text: Any, limit: int = 60) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _last_line(text: str) -> str:
    lines = [line for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _done(run: Run) -> int:
    return sum(1 for step in run.steps if step.get("status") in DONE_STEP_STATUSES)


def _total(run: Run) -> int:
    return len(run.steps) or len((run.raw.get("plan") or {}).get("steps") or [])


def _print_run(client: ExecGo, run: Run) -> None:
    state = run.state + (f" ({run.closing_cause})" if run.closing_cause else "")
    print(_table(["run", str(run.id)], [["title", run.title or "-"], ["state", state],
                                        ["steps", f"{_done(run)}/{_total(run)} done"]]))
    if run.steps:
        rows = []
        for step in run.steps:
            result = step.get("result") or {}
            output = result.get("output") or {}
            error = result.get("error") or {}
            message = error.get("message") if error else _last_line(output.get("stdout", ""))
            rows.append([step.get("id"), step.get("tool"), step.get("status"), output.get("exit_code", ""),
                         _short(message)])
        print()
        print(_table(["STEP", "TOOL", "STATUS", "EXIT", "OUTPUT / ERROR"], rows))
    if run.needs_human:
        print()
        print(f"awaiting human approval: {_approval_url(client, run)}")


def _approval_url(client: ExecGo, run: Run) -> str:
    page = run.approval_page
    return client.url(page) if page else "(the server gave no approval page)"


def _report(client: ExecGo, run: Run, as_json: bool) -> int:
    """Print a run and return the exit code of its state."""
    if as_json:
        _print_json(run.raw)
    else:
        _print_run(client, run)
    if run.needs_human and as_json:
        print(f"awaiting human approval: {_approval_url(client, run)}", file=sys.stderr)
    if run.state == "CLOSED_FAILED":
        for step_id, error in run.step_errors:
            _print_error({"step": step_id, "error": error})
    return EXIT_FOR_STATE.get(run.state, EXIT_OK)


def _waited(client: ExecGo, run: Run, timeout: float, as_json: bool) -> int:
    run = client.wait(run.id, until="any", timeout=timeout)
    code = _report(client, run, as_json)
    if not (run.final or run.needs_human):
        _print_error(ExecGoError("timeout", f"run {run.id} is still {run.state} after {timeout:g}s",
                                 retryable=True, details={"run_id": run.id, "state": run.state}).envelope)
        return EXIT_ERROR
    return code


# --- commands -----------------------------------------------------------


def _load_json(path: str) -> Any:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{path} is not JSON: {exc}") from None


def _plan_and_fields(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    document = _load_json(path)
    if not isinstance(document, dict):
        raise UsageError(f"{path}: expected a JSON object with steps")
    if "plan" in document and "steps" not in document:
        fields = {key: document[key] for key in ("title", "timeout_s", "approval_timeout_s", "callback_url",
                                                 "callback_events") if key in document}
        return document["plan"], fields
    return document, {}


def cmd_submit(client: ExecGo, args: argparse.Namespace) -> int:
    plan, fields = _plan_and_fields(args.plan)
    for name, value in (("title", args.title), ("timeout_s", args.run_timeout),
                        ("approval_timeout_s", args.approval_timeout), ("callback_url", args.callback_url),
                        ("callback_events", args.callback_events)):
        if value is not None:
            fields[name] = value
    run = client.submit(plan, idempotency_key=args.idempotency_key, **fields)
    return _submitted(client, run, args, f"run {run.id} submitted: {run.state}")


def _submitted(client: ExecGo, run: Run, args: argparse.Namespace, line: str) -> int:
    """A run just submitted (or retried): waited for with ``--wait``, else
    shown as JSON or as ``line``."""
    if args.wait:
        return _waited(client, run, args.timeout, args.json)
    if args.json:
        _print_json(run.raw)
    else:
        print(line)
    return EXIT_OK


def cmd_status(client: ExecGo, args: argparse.Namespace) -> int:
    return _report(client, client.get(args.run), args.json)


def cmd_watch(client: ExecGo, args: argparse.Namespace) -> int:
    run = client.get(args.run)
    total, done, state = _total(run), set(), "?"
    if not args.json:
        print(f"run {run.id} {run.title!r}" if run.title else f"run {run.id}")
    for event in client.stream(args.run, last_event_id=args.last_event_id):
        if args.json:
            print(json.dumps(event.raw, default=str), flush=True)
            continue
        if event.type == "run_state_changed":
            state = str(event.data.get("to") or state)
            cause = event.data.get("closing_cause")
            if not total and state == "EXECUTING":  # an llm planner's plan is known by now
                total = _total(client.get(args.run))
            print(f"[{len(done)}/{total} steps] {state}" + (f" ({cause})" if cause else ""), flush=True)
            if state == "AWAITING_HITL":
                current = client.get(args.run)
                if current.needs_human:  # not when replaying the history of a run decided since
                    print(f"  awaiting human approval: {_approval_url(client, current)}", flush=True)
            continue
        line = f"  {event.task_id or '-'}: "
        if event.type == "task_progressed" and "progress" in event.data:
            line += f"{event.data['progress']}% "
        print(line + (event.message or event.type), flush=True)
        if event.type in DONE_TASK_EVENTS and event.task_id:
            done.add(event.task_id)
            print(f"[{len(done)}/{total} steps] {state}", flush=True)
    run = client.get(args.run)
    if args.json:
        return EXIT_FOR_STATE.get(run.state, EXIT_OK)
    print()
    return _report(client, run, as_json=False)


def cmd_cancel(client: ExecGo, args: argparse.Namespace) -> int:
    run = client.cancel(args.run)
    if args.json:
        _print_json(run.raw)
    else:
        print(f"run {run.id}: cancel requested (state {run.state})")
    return EXIT_OK


def cmd_retry(client: ExecGo, args: argparse.Namespace) -> int:
    run = client.retry(args.run)
    return _submitted(client, run, args, f"run {run.id} submitted (retry of {args.run}): {run.state}")


def cmd_evaluate(client: ExecGo, args: argparse.Namespace) -> int:
    plan, _ = _plan_and_fields(args.plan)
    evaluation = client.evaluate(plan)
    if args.json:
        _print_json(evaluation.raw)
        return EXIT_OK
    verdict = "rejected" if evaluation.rejected else "needs a human" if evaluation.needs_human else "runs unattended"
    print(_table(["risk", evaluation.risk], [["verdict", verdict], ["policy", evaluation.policy_version]]))
    if evaluation.steps:
        print()
        print(_table(["STEP", "TOOL", "RISK", "REASONS"],
                     [[step.get("id"), step.get("tool"), step.get("risk"), _short("; ".join(
                         _raising_first(step.get("reasons") or [])), 90)] for step in evaluation.steps]))
    if evaluation.budget:
        print()
        print("budget: " + ", ".join(f"{key}={value}" for key, value in evaluation.budget.items()))
    return EXIT_OK


def cmd_approvals(client: ExecGo, args: argparse.Namespace) -> int:
    approvals = client.approvals(None if args.status == "all" else args.status)
    if args.json:
        _print_json([approval.raw for approval in approvals])
        return EXIT_OK
    if not approvals:
        print(f"no {args.status} approval requests" if args.status != "all" else "no approval requests")
        return EXIT_OK
    print(_table(["ID", "RUN", "STATUS", "RISK", "REQUESTED", "EXPIRES", "PAGE"],
                 [[a.id, a.run_id, a.status, a.risk, a.requested_at[:19], a.expires_at[:19],
                   client.url(a.page_url) if a.page_url else ""] for a in approvals]))
    return EXIT_OK


def cmd_mcp(client: ExecGo, args: argparse.Namespace) -> int:
    from execgo_client.mcp_server import MIN_HTTP_TOKEN_CHARS, serve

    http_token = None
    if args.http:
        # From the environment only: a token on the command line is in every
        # process listing of the machine.
        http_token = os.environ.get(args.token_env, "")
        if len(http_token) < MIN_HTTP_TOKEN_CHARS:
            raise UsageError(f"mcp --http serves only callers with a token: set {args.token_env} to a random "
                             f"string of at least {MIN_HTTP_TOKEN_CHARS} characters (e.g. python3 -c "
                             "'import secrets; print(secrets.token_urlsafe(32))')")
    serve(client, http=args.http, host=args.host, port=args.port, http_token=http_token)
    return EXIT_OK


COMMANDS = {"submit": cmd_submit, "status": cmd_status, "watch": cmd_watch, "cancel": cmd_cancel,
            "retry": cmd_retry, "evaluate": cmd_evaluate, "approvals": cmd_approvals, "mcp": cmd_mcp}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    url = args.url or os.environ.get("EXECGO_URL") or DEFAULT_URL
    token = args.token or os.environ.get("EXECGO_TOKEN")
    if not token:
        _print_error(ExecGoError("invalid_input", "no API token: pass --token or set EXECGO_TOKEN").envelope)
        return EXIT_ERROR
    try:
        with ExecGo(url, token) as client:
            return COMMANDS[args.command](client, args)
    except UsageError as exc:
        _print_error(ExecGoError("invalid_input", str(exc)).envelope)
    except ExecGoError as exc:
        _print_error(exc.envelope)
    except KeyboardInterrupt:
        return 130
    return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
