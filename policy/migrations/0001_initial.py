"""The policy's models move here from the ``runs`` app, where they were
created (runs 0002) and last changed (runs 0007): only Django's picture of
them moves (``SeparateDatabaseAndState``), so an existing database keeps its
tables, ``runs_policyrule`` and ``runs_policyversion``, and their rows. The
content types move too, so the permissions granted on them and the admin's
history stay attached."""

from django.db import migrations, models

MODELS = ("policyrule", "policyversion")


def move_content_types(apps, schema_editor, *, source="runs", target="policy"):
    content_type = apps.get_model("contenttypes", "ContentType")
    rows = content_type.objects.using(schema_editor.connection.alias)
    for model in MODELS:
        if not rows.filter(app_label=target, model=model).exists():
            rows.filter(app_label=source, model=model).update(app_label=target)


def move_content_types_back(apps, schema_editor):
    move_content_types(apps, schema_editor, source="policy", target="runs")


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ("contenttypes", "0002_remove_content_type_name"),
        ("runs", "0019_api_token_digests"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='PolicyRule',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('name', models.CharField(max_length=100, unique=True)),
                        ('tool', models.CharField(help_text='shell, http, file, or * for any tool', max_length=20)),
                        ('field', models.CharField(choices=[('argv', 'Argv'), ('script', 'Script'), ('command', 'Command'), ('words', 'Words'), ('url', 'Url'), ('method', 'Method'), ('path', 'Path'), ('op', 'Op')], max_length=10)),
                        ('pattern', models.CharField(help_text='a Python regular expression, searched in the field (for words: in each parsed simple command and each pipeline; it matches when it is found in any of them)', max_length=500)),
                        ('negate', models.BooleanField(default=False, help_text='match when the pattern is NOT found')),
                        ('outcome', models.CharField(choices=[('low', 'Low'), ('medium', 'Medium'), ('high', 'High'), ('deny', 'Deny')], max_length=10)),
                        ('reason', models.CharField(max_length=300)),
                        ('enabled', models.BooleanField(default=True)),
                        ('priority', models.IntegerField(default=100, help_text='lower runs first; listed in this order in traces')),
                        ('approvals_required', models.PositiveSmallIntegerField(default=1, help_text='distinct approvers a run needs when this rule rates it high (N of the approvers)')),
                        ('updated_at', models.DateTimeField(auto_now=True)),
                    ],
                    options={
                        'db_table': 'runs_policyrule',
                        'ordering': ['priority', 'id'],
                    },
                ),
                migrations.CreateModel(
                    name='PolicyVersion',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('version', models.PositiveIntegerField(default=1)),
                        ('updated_at', models.DateTimeField(auto_now=True)),
                    ],
                    options={
                        'db_table': 'runs_policyversion',
                    },
                ),
            ],
        ),
        migrations.RunPython(move_content_types, move_content_types_back),
    ]
