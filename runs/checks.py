"""System checks (``manage.py check``, and every start) for settings an
operator may still carry from an earlier release, or must never set."""

import os

from django.conf import settings
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


@checks.register(checks.Tags.security)
def fencing_skipped(app_configs, **kwargs) -> list[checks.CheckMessage]:
    """``EXECGO_TEST_SKIP_FENCING`` exists to prove that the fault tests'
    history checker notices a step run twice; set anywhere else it breaks
    the promise that an accepted step runs at most once an attempt."""
    if not settings.EXECGO_TEST_SKIP_FENCING:
        return []
    return [checks.Error(
        "EXECGO_TEST_SKIP_FENCING is set: a step delivered twice runs twice",
        hint="It is a deliberately broken build for the fault tests only; unset it.",
        id="execgo.E001",
    )]
