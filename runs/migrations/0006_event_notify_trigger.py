"""On PostgreSQL, every INSERT into the Event outbox NOTIFYs ``execgo_events``
(delivered at commit, once per transaction), which wakes each web process's
live relay (runs/web/relay.py). SQLite has no NOTIFY: the relay polls."""

from django.db import migrations

CREATE = """
CREATE OR REPLACE FUNCTION execgo_event_notify() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('execgo_events', '');
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;
DROP TRIGGER IF EXISTS runs_event_notify ON runs_event;
CREATE TRIGGER runs_event_notify AFTER INSERT ON runs_event
    FOR EACH STATEMENT EXECUTE FUNCTION execgo_event_notify();
"""
DROP = """
DROP TRIGGER IF EXISTS runs_event_notify ON runs_event;
DROP FUNCTION IF EXISTS execgo_event_notify();
"""


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("runs", "0005_audit_event_choices")]
    operations = [migrations.RunPython(create, drop)]
