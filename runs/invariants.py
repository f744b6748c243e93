"""The reconciliation invariants, checked against the rows
(docs/state-machine.md#reconciliation-invariants).

- count(SUCCEEDED runs) == count(AuditLog ``run_succeeded``);
- every final run has exactly one final AuditLog event, the one matching
  its state, and passed TRACING (its final transition came from TRACING);
- every Job's status is the projection of its latest run's state;
- every tenant's audit chain is unbroken (``audit_chain_breaks``).
"""

from collections import Counter, defaultdict

from runs.audit_hash import GENESIS, NO_TENANT_CHAIN, row_content, row_digest
from runs.models import FINAL_AUDIT_EVENT, AuditChainHead, AuditEvent, AuditLog, Job, Run, Trace, TraceKind
from runs.statemachine import FINAL, RunState, job_status_for


def find_violations() -> list[str]:
    violations: list[str] = []

    succeeded_runs = Run.objects.filter(state=RunState.SUCCEEDED).count()
    succeeded_audits = AuditLog.objects.filter(event=AuditEvent.RUN_SUCCEEDED).count()
    if succeeded_runs != succeeded_audits:
        violations.append(
            f"{succeeded_runs} SUCCEEDED runs but {succeeded_audits} run_succeeded audit events"
        )

    final_events = defaultdict(Counter)
    for run_id, event in AuditLog.objects.filter(event__in=FINAL_AUDIT_EVENT.values()).values_list("run_id", "event"):
        final_events[run_id][event] += 1
    entered_final_from = dict(
        Trace.objects.filter(kind=TraceKind.TRANSITION, to_state__in=FINAL).values_list("run_id", "from_state")
    )
    final_runs = dict(Run.objects.filter(state__in=FINAL).values_list("pk", "state"))

    for run_id, state in sorted(final_runs.items()):
        events = final_events.get(run_id, Counter())
        expected = FINAL_AUDIT_EVENT[state]
        if sum(events.values()) != 1 or events[expected] != 1:
            violations.append(f"run {run_id} is {state} but has final audit events {dict(events) or 'none'}")
        source = entered_final_from.get(run_id)
        if source != RunState.TRACING:
            violations.append(f"run {run_id} is {state} but did not pass TRACING (entered from {source or 'nowhere'})")

    for run_id in sorted(set(final_events) - set(final_runs)):
        violations.append(f"run {run_id} has final audit events {dict(final_events[run_id])} but is not final")

    for job_id, status, latest_state in Job.objects.filter(latest_run__isnull=False).values_list(
        "pk", "status", "latest_run__state"
    ):
        if status != job_status_for(latest_state):
            violations.append(f"job {job_id} reads {status!r} but its latest run is {latest_state}")
    violations += audit_chain_breaks()
    return violations


def _short(digest: str) -> str:
    return digest[:16] or "(empty)"


def _row_break(row: AuditLog, last: AuditLog | None) -> str | None:
    """What is wrong with ``row`` as the link after ``last`` (None: the
    chain's start), or None."""
    expected_seq = last.chain_seq + 1 if last else 1
    expected_prev = last.row_hash if last else GENESIS
    where = (f"audit chain of tenant {row.tenant_id} (lane {row.chain_lane}) broken at row {row.pk} "
             f"(seq {row.chain_seq}, {row.event})")
    if row.chain_seq != expected_seq:
        return f"{where}: expected seq {expected_seq}, rows {expected_seq}..{row.chain_seq - 1} are missing"
    if row.prev_hash != expected_prev:
        before = f"row {last.pk}" if last else "the chain's start"
        return (f"{where}: prev_hash {_short(row.prev_hash)} is not the row_hash of {before} "
                f"({_short(expected_prev)})")
    computed = row_digest(row_content(row))
    if computed != row.row_hash:
        return (f"{where}: its content does not match its row_hash (stored {_short(row.row_hash)}, "
                f"content hashes to {_short(computed)})")
    return None


def audit_chain_breaks() -> list[str]:
    """Walk every tenant's audit chain in ``chain_seq`` order and name its
    first broken link: a row whose content no longer matches its
    ``row_hash`` (edited), a ``prev_hash`` that is not the row before's
    (inserted, reordered, or the row before edited), a gap in ``chain_seq``
    (deleted), or a head that disagrees with the last row (the tail cut off).
    Rows after a break are not judged: the first one is what to look at."""
    breaks: list[str] = []
    for row_id, tenant_id in AuditLog.objects.filter(chain_seq__isnull=True).values_list("pk", "tenant_id"):
        breaks.append(f"audit row {row_id} (tenant {tenant_id}) is outside the chain: no chain_seq, no hash")
    heads = {(head.chain, head.lane): head for head in AuditChainHead.objects.all()}
    walked: set[tuple[int, int]] = set()

    def close(chain: tuple[int, int], tenant_id, last, broken: bool) -> None:
        walked.add(chain)
        if broken:
            return
        head = heads.get(chain)
        last_seq, last_hash = (last.chain_seq, last.row_hash) if last else (0, GENESIS)
        if head is None:
            breaks.append(f"audit chain of tenant {tenant_id} (lane {chain[1]}): its head is missing "
                          f"(last row seq {last_seq})")
        elif (head.seq, head.last_hash or GENESIS) != (last_seq, last_hash):
            where = f"row {last.pk} (seq {last_seq})" if last else "no row"
            breaks.append(f"audit chain of tenant {tenant_id} (lane {chain[1]}) broken after {where}: the head is at "
                          f"seq {head.seq} "
                          f"hash {_short(head.last_hash)}, the last row hashes to {_short(last_hash)} "
                          "(rows at the end are missing)")

    rows = AuditLog.objects.filter(chain_seq__isnull=False).order_by("tenant_id", "chain_lane", "chain_seq")
    chain, tenant_id, last, broken = None, None, None, False
    for row in rows.iterator(chunk_size=2000):
        row_chain = (row.tenant_id or NO_TENANT_CHAIN, row.chain_lane)
        if row_chain != chain:
            if chain is not None:
                close(chain, tenant_id, last, broken)
            chain, tenant_id, last, broken = row_chain, row.tenant_id, None, False
        if broken:
            continue
        problem = _row_break(row, last)
        if problem:
            breaks.append(problem)
            broken = True
        last = row
    if chain is not None:
        close(chain, tenant_id, last, broken)
    for (chain_id, lane), head in sorted(heads.items()):
        if (chain_id, lane) not in walked and head.seq:
            breaks.append(f"audit chain of tenant {chain_id or None} (lane {lane}): the head is at seq {head.seq} "
                          "but no row is left")
    return breaks
