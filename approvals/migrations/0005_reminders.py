"""A request's reminders sent and when it escalated (docs/approvals.md#reminders-and-escalation)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('approvals', '0004_notifications'),
    ]

    operations = [
        migrations.AddField(
            model_name='approvalrequest',
            name='escalated_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='approvalrequest',
            name='reminders_sent',
            field=models.PositiveSmallIntegerField(default=0),
        ),
    ]
