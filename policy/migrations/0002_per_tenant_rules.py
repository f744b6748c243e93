"""Rules of a tenant's own and a version per tenant: a rule's tenant (empty: global, as every
existing rule stays), names unique among the global rules and within a tenant, a tenant's version
keyed by the tenant, and a rule's own reminder fractions and escalation delay
(docs/policy.md#per-tenant-rules, docs/approvals.md#reminders-and-escalation)."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('policy', '0001_initial'),
        ('runs', '0025_decision_link_sign_in'),
    ]

    operations = [
        migrations.CreateModel(
            name='TenantPolicyVersion',
            fields=[
                ('tenant', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, primary_key=True, related_name='policy_version', serialize=False, to='runs.tenant')),
                ('version', models.PositiveIntegerField()),
                ('updated_at', models.DateTimeField(auto_now=True)),
            ],
        ),
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
        migrations.AddField(
            model_name='policyrule',
            name='tenant',
            field=models.ForeignKey(blank=True, help_text='empty: a global rule, for every tenant', null=True, on_delete=django.db.models.deletion.CASCADE, related_name='policy_rules', to='runs.tenant'),
        ),
        migrations.AlterField(
            model_name='policyrule',
            name='name',
            field=models.CharField(max_length=100),
        ),
        migrations.AddConstraint(
            model_name='policyrule',
            constraint=models.UniqueConstraint(condition=models.Q(('tenant__isnull', True)), fields=('name',), name='policy_rule_global_name_unique'),
        ),
        migrations.AddConstraint(
            model_name='policyrule',
            constraint=models.UniqueConstraint(fields=('tenant', 'name'), name='policy_rule_tenant_name_unique'),
        ),
    ]
