"""API tokens as digests (runs.models.ApiToken), replacing DRF's authtoken.

A database that had ``rest_framework.authtoken`` keeps its agents' tokens:
each plain key in ``authtoken_token`` becomes a row holding its digest and
prefix, then that table (the only place the keys were) is dropped and
authtoken's migration records are removed, so the app could be installed
again from scratch. The table is read with SQL, since the app is no longer
installed. Going back cannot bring the keys back: tokens issued since then
are lost with the table and agents need new ones.
"""

import hashlib
from datetime import UTC

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models

PLAIN_TOKENS = "authtoken_token"
KEY_PREFIX_CHARS = 8  # runs.models.tokens, frozen here as migrations must be


def digest_plain_tokens(apps, schema_editor):
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        if PLAIN_TOKENS not in connection.introspection.table_names(cursor):
            return  # a database that never had authtoken
        quote = connection.ops.quote_name
        cursor.execute(f"SELECT {quote('key')}, {quote('user_id')}, {quote('created')} FROM {quote(PLAIN_TOKENS)}")
        rows = cursor.fetchall()
    ApiToken = apps.get_model("runs", "ApiToken")
    # SQLite keeps datetimes without their zone; Django writes them in UTC.
    rows = [(key, user_id, created if created.tzinfo else created.replace(tzinfo=UTC)) for key, user_id, created in rows]
    ApiToken.objects.using(connection.alias).bulk_create([
        ApiToken(user_id=user_id, name="token of the earlier scheme", key_prefix=key[:KEY_PREFIX_CHARS],
                 digest=hashlib.sha256(key.encode("ascii")).hexdigest(), created_at=created)
        for key, user_id, created in rows
    ])
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE {quote(PLAIN_TOKENS)}")
        cursor.execute(f"DELETE FROM {quote('django_migrations')} WHERE {quote('app')} = %s", ["authtoken"])


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0018_tenant_webhook_secret'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name='ApiToken',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('name', models.CharField(blank=True, help_text="what the token is for, e.g. the agent's host", max_length=100)),
                ('key_prefix', models.CharField(db_index=True, editable=False, max_length=8)),
                ('digest', models.CharField(editable=False, max_length=64, unique=True)),
                ('created_at', models.DateTimeField(default=django.utils.timezone.now, editable=False)),
                ('expires_at', models.DateTimeField(blank=True, help_text='empty: never expires', null=True)),
                ('last_used_at', models.DateTimeField(blank=True, editable=False, null=True)),
                ('revoked_at', models.DateTimeField(blank=True, editable=False, null=True)),
                ('user', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='api_tokens', to=settings.AUTH_USER_MODEL)),
            ],
            options={
                'verbose_name': 'API token',
                'ordering': ('-created_at', '-id'),
            },
        ),
        migrations.RunPython(digest_plain_tokens, migrations.RunPython.noop),
    ]
