import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):
    """A trace's time is the change's, set when it is recorded (its row may
    be written at the end of the transaction). No column changes: a Python
    default, not the database's, so the table is left as it is (SQLite would
    otherwise copy it whole)."""

    dependencies = [
        ("runs", "0025_decision_link_sign_in"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="trace",
                    name="created_at",
                    field=models.DateTimeField(default=django.utils.timezone.now, editable=False),
                ),
            ],
        ),
    ]
