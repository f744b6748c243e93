"""An audit chain's head may move forward by several links at once: the
rows a transaction holds to its end (``runs.recording``) are appended
together and the head is updated once, to the last of them. It still never
moves back, never changes lane or chain, and is never deleted; a head that
runs ahead of its rows fails the verifier as it did before
(``execgo_reconcile``, ``tools/verify_audit.py``).

This replaces the head's trigger of 0010; a later migration that rebuilds
the head's SQLite table must create this one again (``create_trigger``)."""

from django.db import migrations

PG_FUNCTION = """
CREATE OR REPLACE FUNCTION execgo_audit_head_forward_only() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'runs_auditchainhead only moves forward: DELETE of head % refused', OLD.id
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF NOT (NEW.chain = OLD.chain AND NEW.lane = OLD.lane AND (NEW.seq {step}
            OR (NEW.seq = OLD.seq AND NEW.last_hash = OLD.last_hash))) THEN
        RAISE EXCEPTION 'runs_auditchainhead only moves forward: seq % to % refused', OLD.seq, NEW.seq
            USING ERRCODE = 'restrict_violation';
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;
"""
SQLITE_TRIGGER = [
    "DROP TRIGGER IF EXISTS runs_auditchainhead_forward_only",
    "CREATE TRIGGER runs_auditchainhead_forward_only BEFORE UPDATE ON runs_auditchainhead "
    "WHEN NOT (NEW.chain = OLD.chain AND NEW.lane = OLD.lane AND (NEW.seq {step} "
    "OR (NEW.seq = OLD.seq AND NEW.last_hash = OLD.last_hash))) "
    "BEGIN SELECT RAISE(ABORT, 'runs_auditchainhead only moves forward: UPDATE refused'); END",
]
BY_ANY = "> OLD.seq"
BY_ONE = "= OLD.seq + 1"  # 0010's


def _create(schema_editor, step: str) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(PG_FUNCTION.replace("{step}", step), params=None)  # RAISE formats with %
    elif schema_editor.connection.vendor == "sqlite":
        for statement in SQLITE_TRIGGER:
            schema_editor.execute(statement.replace("{step}", step))


def create_trigger(apps, schema_editor):
    _create(schema_editor, BY_ANY)


def restore_trigger(apps, schema_editor):
    _create(schema_editor, BY_ONE)


class Migration(migrations.Migration):

    dependencies = [
        ("runs", "0026_trace_created_when_recorded"),
    ]

    operations = [
        migrations.RunPython(create_trigger, restore_trigger),
    ]
