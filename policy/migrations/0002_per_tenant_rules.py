"""Rules and versions of a tenant's own: a rule's tenant (empty: global, as
every existing rule stays), names unique among the global rules and within
a tenant, and a version row per tenant beside the global row 1."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('policy', '0001_initial'),
        ('runs', '0020_policy_moves_to_its_app'),
    ]

    operations = [
        migrations.AddField(
            model_name='policyrule',
            name='tenant',
            field=models.ForeignKey(blank=True, help_text='empty: a global rule, for every tenant', null=True, on_delete=django.db.models.deletion.CASCADE, related_name='policy_rules', to='runs.tenant'),
        ),
        migrations.AddField(
            model_name='policyversion',
            name='tenant',
            field=models.OneToOneField(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='policy_version', to='runs.tenant'),
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
