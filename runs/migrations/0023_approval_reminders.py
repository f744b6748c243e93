"""Approval reminders and escalation: when a tenant's approvers are reminded, when and whom a pending
request escalates to, and the audit event of an escalation (docs/approvals.md#reminders-and-escalation)."""

from django.db import migrations, models

import runs.models.run


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0022_decision_link_audit'),
    ]

    operations = [
        migrations.AddField(
            model_name='tenant',
            name='approval_escalation_after_s',
            field=models.PositiveIntegerField(default=0, help_text='seconds after a request opened that its escalation group is told (0: never)'),
        ),
        migrations.AddField(
            model_name='tenant',
            name='approval_escalation_group',
            field=models.CharField(default='escalation', help_text='the group told of an escalated request, who may decide it', max_length=150),
        ),
        migrations.AddField(
            model_name='tenant',
            name='approval_reminder_fractions',
            field=models.JSONField(blank=True, default=runs.models.run.default_reminder_fractions, help_text='when approvers are reminded of a pending request: fractions of its time, e.g. [0.5, 0.9]'),
        ),
        migrations.AlterField(
            model_name='auditlog',
            name='event',
            field=models.CharField(choices=[('run_created', 'Run Created'), ('state_changed', 'State Changed'), ('run_succeeded', 'Run Succeeded'), ('run_rejected', 'Run Rejected'), ('run_failed', 'Run Failed'), ('run_cancelled', 'Run Cancelled'), ('invalid_transition', 'Invalid Transition'), ('transition_lost', 'Transition Lost'), ('cancel_requested', 'Cancel Requested'), ('cancel_refused', 'Cancel Refused'), ('cancel_superseded', 'Cancel Superseded'), ('approval_approved', 'Approval Approved'), ('approval_rejected', 'Approval Rejected'), ('approval_refused', 'Approval Refused'), ('zombie_detected', 'Zombie Detected'), ('zombie_recovered', 'Zombie Recovered'), ('step_reattached', 'Step Reattached'), ('stale_result_ignored', 'Stale Result Ignored'), ('artifacts_purged', 'Artifacts Purged'), ('approval_requested', 'Approval Requested'), ('approval_voided', 'Approval Voided'), ('hitl_timeout', 'Hitl Timeout'), ('reservation_reclaimed', 'Reservation Reclaimed'), ('deadline_enforced', 'Deadline Enforced'), ('approval_stale_view', 'Approval Stale View'), ('work_resent', 'Work Resent'), ('admin_changed', 'Admin Changed'), ('token_created', 'Token Created'), ('token_revoked', 'Token Revoked'), ('grant_created', 'Grant Created'), ('grant_applied', 'Grant Applied'), ('grant_revoked', 'Grant Revoked'), ('decision_link_used', 'Decision Link Used'), ('approval_escalated', 'Approval Escalated'), ('decision_link_refused', 'Decision Link Refused')], max_length=40),
        ),
    ]
