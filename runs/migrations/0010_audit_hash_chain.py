"""The audit log becomes tamper-evident: a hash chain per tenant (existing
rows are chained in id order), a head row per chain, and triggers that
refuse UPDATE and DELETE of an audit row, and let a head only move forward
(one link at a time; never deleted).

PostgreSQL: one BEFORE UPDATE OR DELETE row trigger. TRUNCATE fires no row
trigger: it needs the TRUNCATE privilege, which the application's role
should not have in production (the test suite's flush truncates). SQLite:
UPDATE is refused; DELETE too unless the connection's
``execgo_audit_erasable()`` says 1 (``runs.audit.sqlite_audit_erasable``,
set by ``manage.py flush``); a connection without that function (the sqlite3
shell) is refused. Django rebuilds a SQLite table to alter it, which drops its
triggers: a later migration that alters AuditLog must create them again
(``create_triggers``).
"""

import django.utils.timezone
from django.conf import settings
from django.db import migrations, models

PG_CREATE = """
CREATE OR REPLACE FUNCTION execgo_audit_append_only() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'runs_auditlog is append-only: % of audit row % refused', TG_OP, OLD.id
        USING ERRCODE = 'restrict_violation';
END;
$$ LANGUAGE plpgsql;
DROP TRIGGER IF EXISTS runs_auditlog_append_only ON runs_auditlog;
CREATE TRIGGER runs_auditlog_append_only BEFORE UPDATE OR DELETE ON runs_auditlog
    FOR EACH ROW EXECUTE FUNCTION execgo_audit_append_only();
CREATE OR REPLACE FUNCTION execgo_audit_head_forward_only() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'runs_auditchainhead only moves forward: DELETE of head % refused', OLD.id
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF NOT (NEW.chain = OLD.chain AND NEW.lane = OLD.lane AND (NEW.seq = OLD.seq + 1
            OR (NEW.seq = OLD.seq AND NEW.last_hash = OLD.last_hash))) THEN
        RAISE EXCEPTION 'runs_auditchainhead only moves forward: seq % to % refused', OLD.seq, NEW.seq
            USING ERRCODE = 'restrict_violation';
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;
DROP TRIGGER IF EXISTS runs_auditchainhead_forward_only ON runs_auditchainhead;
CREATE TRIGGER runs_auditchainhead_forward_only BEFORE UPDATE OR DELETE ON runs_auditchainhead
    FOR EACH ROW EXECUTE FUNCTION execgo_audit_head_forward_only();
"""
PG_DROP = """
DROP TRIGGER IF EXISTS runs_auditlog_append_only ON runs_auditlog;
DROP FUNCTION IF EXISTS execgo_audit_append_only();
DROP TRIGGER IF EXISTS runs_auditchainhead_forward_only ON runs_auditchainhead;
DROP FUNCTION IF EXISTS execgo_audit_head_forward_only();
"""
SQLITE_CREATE = [
    "DROP TRIGGER IF EXISTS runs_auditlog_no_update",
    "CREATE TRIGGER runs_auditlog_no_update BEFORE UPDATE ON runs_auditlog "
    "BEGIN SELECT RAISE(ABORT, 'runs_auditlog is append-only: UPDATE refused'); END",
    "DROP TRIGGER IF EXISTS runs_auditlog_no_delete",
    "CREATE TRIGGER runs_auditlog_no_delete BEFORE DELETE ON runs_auditlog WHEN NOT execgo_audit_erasable() "
    "BEGIN SELECT RAISE(ABORT, 'runs_auditlog is append-only: DELETE refused'); END",
    "DROP TRIGGER IF EXISTS runs_auditchainhead_forward_only",
    "CREATE TRIGGER runs_auditchainhead_forward_only BEFORE UPDATE ON runs_auditchainhead "
    "WHEN NOT (NEW.chain = OLD.chain AND NEW.lane = OLD.lane AND (NEW.seq = OLD.seq + 1 "
    "OR (NEW.seq = OLD.seq AND NEW.last_hash = OLD.last_hash))) "
    "BEGIN SELECT RAISE(ABORT, 'runs_auditchainhead only moves forward: UPDATE refused'); END",
    "DROP TRIGGER IF EXISTS runs_auditchainhead_no_delete",
    "CREATE TRIGGER runs_auditchainhead_no_delete BEFORE DELETE ON runs_auditchainhead "
    "WHEN NOT execgo_audit_erasable() "
    "BEGIN SELECT RAISE(ABORT, 'runs_auditchainhead only moves forward: DELETE refused'); END",
]
SQLITE_DROP = ["DROP TRIGGER IF EXISTS runs_auditlog_no_update", "DROP TRIGGER IF EXISTS runs_auditlog_no_delete",
               "DROP TRIGGER IF EXISTS runs_auditchainhead_forward_only",
               "DROP TRIGGER IF EXISTS runs_auditchainhead_no_delete"]


def create_triggers(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(PG_CREATE, params=None)  # no placeholders: RAISE formats with %
    elif schema_editor.connection.vendor == "sqlite":
        for statement in SQLITE_CREATE:
            schema_editor.execute(statement)


def drop_triggers(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(PG_DROP)
    elif schema_editor.connection.vendor == "sqlite":
        for statement in SQLITE_DROP:
            schema_editor.execute(statement)


def chain_existing_rows(apps, schema_editor):
    """Chain the rows written before the chain existed, in id order."""
    from runs.audit_hash import GENESIS, NO_TENANT_CHAIN, row_content, row_digest

    AuditLog = apps.get_model("runs", "AuditLog")
    AuditChainHead = apps.get_model("runs", "AuditChainHead")
    db = schema_editor.connection.alias
    heads: dict[int, tuple[int, str]] = {}
    batch = []
    for row in AuditLog.objects.using(db).order_by("id").iterator(chunk_size=2000):
        chain = row.tenant_id or NO_TENANT_CHAIN
        seq, last_hash = heads.get(chain, (0, GENESIS))
        row.chain_lane, row.chain_seq, row.prev_hash = 0, seq + 1, last_hash
        row.row_hash = row_digest(row_content(row))
        heads[chain] = (row.chain_seq, row.row_hash)
        batch.append(row)
        if len(batch) >= 2000:
            AuditLog.objects.using(db).bulk_update(batch, ["chain_lane", "chain_seq", "prev_hash", "row_hash"])
            batch = []
    AuditLog.objects.using(db).bulk_update(batch, ["chain_lane", "chain_seq", "prev_hash", "row_hash"])
    AuditChainHead.objects.using(db).bulk_create(
        [AuditChainHead(chain=chain, lane=0, seq=seq, last_hash=last_hash) for chain, (seq, last_hash) in heads.items()]
    )


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0009_run_idempotency_fingerprint_callbacks'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name='AuditChainHead',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('chain', models.BigIntegerField()),
                ('lane', models.PositiveSmallIntegerField(default=0)),
                ('seq', models.PositiveBigIntegerField(default=0)),
                ('last_hash', models.CharField(blank=True, max_length=64)),
            ],
        ),
        migrations.AddField(
            model_name='auditlog',
            name='chain_lane',
            field=models.PositiveSmallIntegerField(default=0),
        ),
        migrations.AddField(
            model_name='auditlog',
            name='chain_seq',
            field=models.PositiveBigIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='auditlog',
            name='prev_hash',
            field=models.CharField(blank=True, max_length=64),
        ),
        migrations.AddField(
            model_name='auditlog',
            name='row_hash',
            field=models.CharField(blank=True, max_length=64),
        ),
        migrations.AlterField(
            model_name='auditlog',
            name='created_at',
            field=models.DateTimeField(default=django.utils.timezone.now),
        ),
        migrations.RunPython(chain_existing_rows, migrations.RunPython.noop),
        migrations.AddConstraint(
            model_name='auditlog',
            constraint=models.UniqueConstraint(fields=('tenant', 'chain_lane', 'chain_seq'), name='audit_chain_link'),
        ),
        migrations.AddConstraint(
            model_name='auditlog',
            constraint=models.UniqueConstraint(condition=models.Q(('tenant__isnull', True)), fields=('chain_lane', 'chain_seq'), name='audit_chain_link_no_tenant'),
        ),
        migrations.AddConstraint(
            model_name='auditchainhead',
            constraint=models.UniqueConstraint(fields=('chain', 'lane'), name='audit_chain_head'),
        ),
        migrations.RunPython(create_triggers, drop_triggers),
    ]
