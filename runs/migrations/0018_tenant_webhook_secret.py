"""Each tenant gets a webhook secret of its own: existing tenants one each
(a callable default on AddField would be evaluated once and shared by all)."""

import secrets

from django.db import migrations, models

import runs.models.run


def give_each_tenant_a_secret(apps, schema_editor):
    Tenant = apps.get_model("runs", "Tenant")
    for tenant in Tenant.objects.filter(webhook_secret="").only("pk"):
        Tenant.objects.filter(pk=tenant.pk).update(webhook_secret=secrets.token_urlsafe(32))


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0017_auditlog_event_admin_and_tokens'),
    ]

    operations = [
        migrations.AddField(
            model_name='tenant',
            name='webhook_secret',
            field=models.CharField(default='', editable=False, max_length=64),
            preserve_default=False,
        ),
        migrations.RunPython(give_each_tenant_a_secret, migrations.RunPython.noop),
        migrations.AlterField(
            model_name='tenant',
            name='webhook_secret',
            field=models.CharField(default=runs.models.run.new_webhook_secret, editable=False, max_length=64),
        ),
    ]
