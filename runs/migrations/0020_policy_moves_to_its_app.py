"""The policy's models are the policy app's now (policy 0001): they leave
Django's picture of this app, and their tables stay where they are."""

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("runs", "0019_api_token_digests"),
        ("policy", "0001_initial"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.DeleteModel(name="PolicyRule"),
                migrations.DeleteModel(name="PolicyVersion"),
            ],
        ),
    ]
