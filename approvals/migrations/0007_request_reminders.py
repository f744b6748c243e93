"""A request's reminder fractions and escalation delay, from the rule that rated it high
(docs/approvals.md#reminders-and-escalation)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('approvals', '0006_delegation'),
    ]

    operations = [
        migrations.AddField(
            model_name='approvalrequest',
            name='escalation_after_s',
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='approvalrequest',
            name='reminder_fractions',
            field=models.JSONField(blank=True, null=True),
        ),
    ]
