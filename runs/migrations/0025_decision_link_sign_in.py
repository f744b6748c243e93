"""The audit event of a decision link signing its approver in (docs/approvals.md#decision-links)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0024_delegation_audit'),
    ]

    operations = [
        migrations.AlterField(
            model_name='auditlog',
            name='event',
            field=models.CharField(choices=[('run_created', 'Run Created'), ('state_changed', 'State Changed'), ('run_succeeded', 'Run Succeeded'), ('run_rejected', 'Run Rejected'), ('run_failed', 'Run Failed'), ('run_cancelled', 'Run Cancelled'), ('invalid_transition', 'Invalid Transition'), ('transition_lost', 'Transition Lost'), ('cancel_requested', 'Cancel Requested'), ('cancel_refused', 'Cancel Refused'), ('cancel_superseded', 'Cancel Superseded'), ('approval_approved', 'Approval Approved'), ('approval_rejected', 'Approval Rejected'), ('approval_refused', 'Approval Refused'), ('zombie_detected', 'Zombie Detected'), ('zombie_recovered', 'Zombie Recovered'), ('step_reattached', 'Step Reattached'), ('stale_result_ignored', 'Stale Result Ignored'), ('artifacts_purged', 'Artifacts Purged'), ('approval_requested', 'Approval Requested'), ('approval_voided', 'Approval Voided'), ('hitl_timeout', 'Hitl Timeout'), ('reservation_reclaimed', 'Reservation Reclaimed'), ('deadline_enforced', 'Deadline Enforced'), ('approval_stale_view', 'Approval Stale View'), ('work_resent', 'Work Resent'), ('admin_changed', 'Admin Changed'), ('token_created', 'Token Created'), ('token_revoked', 'Token Revoked'), ('grant_created', 'Grant Created'), ('grant_applied', 'Grant Applied'), ('grant_revoked', 'Grant Revoked'), ('decision_link_used', 'Decision Link Used'), ('approval_escalated', 'Approval Escalated'), ('delegation_set', 'Delegation Set'), ('decision_link_sign_in', 'Decision Link Sign In'), ('decision_link_refused', 'Decision Link Refused')], max_length=40),
        ),
    ]
