"""The approvals' tables: requests, decisions and standing grants
(``requests.py``), and the notifications sent about requests and the
one-time decision links in them (``notices.py``)."""

from approvals.models.notices import (
    ChatFormat,
    DecisionLink,
    Notification,
    NotificationChannel,
    NotificationKind,
    NotificationSettings,
    NotificationStatus,
)
from approvals.models.requests import (
    AGENTS_GROUP,
    APPROVERS_GROUP,
    ApprovalRequest,
    ApprovalStatus,
    Decision,
    DecisionKind,
    StandingGrant,
    action_digest,
    grant_digest,
    normalised_action,
    plan_version,
    quorum_of,
    rated_steps,
    reminders_of,
    shown_action,
    visible_text,
)

__all__ = ["AGENTS_GROUP", "APPROVERS_GROUP", "ApprovalRequest", "ApprovalStatus", "ChatFormat", "Decision",
           "DecisionKind", "DecisionLink", "Notification", "NotificationChannel", "NotificationKind",
           "NotificationSettings", "NotificationStatus", "StandingGrant", "action_digest", "grant_digest",
           "normalised_action", "plan_version", "quorum_of", "rated_steps", "reminders_of", "shown_action",
           "visible_text"]
