"""System checks (``manage.py check``, and every start) for settings an
operator may still carry from an earlier release."""

import os

from django.core import checks


@checks.register(checks.Tags.security)
def retired_webhook_secret(app_configs, **kwargs) -> list[checks.CheckMessage]:
    """``EXECGO_WEBHOOK_SECRET`` signed every tenant's webhooks once; each
    tenant now has a secret of its own (``Tenant.webhook_secret``) and the
    variable is read nowhere, so receivers still verifying with it refuse
    every delivery."""
    if not os.environ.get("EXECGO_WEBHOOK_SECRET"):
        return []
    return [checks.Warning(
        "EXECGO_WEBHOOK_SECRET is set but no longer used: webhooks are signed with each tenant's own secret",
        hint="Give each receiver its tenant's secret (the tenant's page in the admin) and unset the variable.",
        id="execgo.W001",
    )]
