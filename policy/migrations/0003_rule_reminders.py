"""A rule's own reminder fractions and escalation delay for the requests it opens
(docs/approvals.md#reminders-and-escalation)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('policy', '0002_per_tenant_rules'),
    ]

    operations = [
        migrations.AddField(
            model_name='policyrule',
            name='escalation_after_s',
            field=models.PositiveIntegerField(blank=True, help_text="seconds until the tenant's escalation group is told (empty: the tenant's; 0: never)", null=True),
        ),
        migrations.AddField(
            model_name='policyrule',
            name='reminder_fractions',
            field=models.JSONField(blank=True, help_text="fractions of the request's time to remind approvers at, e.g. [0.5, 0.9] (empty: the tenant's)", null=True),
        ),
    ]
