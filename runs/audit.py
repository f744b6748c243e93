"""The one writer of AuditLog rows.

Every row names an ``AuditEvent``. Most rows commit with the change they
record, on the caller's connection. A row that must outlive the rollback of
the caller's transaction (an illegal or lost transition, a refused request)
is written ``independently``: on PostgreSQL through the second ("audit")
connection, which commits on its own. SQLite has a single writer and the
caller's open transaction holds it, so there such a row can only ride with
that transaction; outside a transaction both commit at once anyway.
"""

from typing import Any

from django.conf import settings
from django.db import connection

from runs.models import AuditEvent, AuditLog
from runtime import statements


def audit(event: AuditEvent, *, run_id: int | None, tenant_id: int | None, actor: Any = None, caller: str = "",
          forced_by: str = "", from_state: str = "", to_state: str = "", data: dict[str, Any] | None = None,
          independently: bool = False) -> None:
    row = AuditLog(run_id=run_id, tenant_id=tenant_id, event=event, actor=user_or_none(actor), caller=caller,
                   forced_by=forced_by, from_state=from_state, to_state=to_state, data=data or {})
    alias = "audit" if independently and connection.in_atomic_block and not settings.IS_SQLITE else "default"
    statements.insert([row], using=alias)


def user_or_none(actor: Any):
    """The user to name as actor: agents and people are users; an anonymous
    caller or a process (the sweeper, recovery) is named by ``caller``."""
    return actor if getattr(actor, "is_authenticated", False) else None
