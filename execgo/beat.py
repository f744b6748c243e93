"""Beat's schedule: the periodic tasks that keep runs moving and the
machine tidy when a message, a worker or a timer was lost.

The settings read the intervals from the environment and pass them in.
"""

from typing import Any


def beat_schedule(*, sweep_s: float, gc_s: float, deadline_scan_s: float, dispatch_relay_s: float,
                  ledger_heal_s: float, notify_relay_s: float = 60.0,
                  reminder_scan_s: float = 5.0) -> dict[str, dict[str, Any]]:
    """The periodic tasks beat sends (intervals in seconds). /readyz reads
    the sweeper's entry to tell that beat runs."""
    return {
        "sweep-zombie-runs": {
            "task": "runs.tasks.sweep_zombie_runs",
            "schedule": sweep_s,
        },
        "purge-expired-run-artifacts": {
            "task": "runs.tasks.purge_expired_run_artifacts",
            "schedule": gc_s,
        },
        # Closes a run whose deadline passed when its timer (an ETA message)
        # was lost or is parked in a dead worker's unacked set.
        "scan-run-deadlines": {
            "task": "runs.tasks.scan_run_deadlines",
            "schedule": deadline_scan_s,
        },
        # Sends what the broker had not taken (runs.dispatch: a broker outage).
        "relay-dispatches": {
            "task": "runs.tasks.relay_dispatched_messages",
            "schedule": dispatch_relay_s,
        },
        # Gives back the reservations of pool processes that died mid-step.
        "heal-ledgers": {
            "task": "runs.tasks.heal_ledgers",
            "schedule": ledger_heal_s,
        },
        # Sends again the approvers' notifications whose message was lost.
        "relay-notifications": {
            "task": "approvals.tasks.relay_notifications",
            "schedule": notify_relay_s,
        },
        # Reminds approvers of pending requests, and escalates them, when due.
        "send-approval-reminders": {
            "task": "approvals.tasks.send_reminders",
            "schedule": reminder_scan_s,
        },
    }
