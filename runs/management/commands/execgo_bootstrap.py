"""Create the demo tenant and its three users; safe to run on every start.

A second run changes nothing: existing rows are kept, an existing password
is kept unless a different one is given, and the agent keeps its token.
Secrets go to this command's stdout only, never through ``logging``: log
handlers ship lines to places a shell's stdout does not go. The agent's key
is printed once, when its token is created: only its digest is stored. An
agent whose tokens were all revoked or have expired gets a new one.
"""

import os
import secrets
from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.contrib.auth.hashers import make_password
from django.contrib.auth.models import Group
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from runs.models import ApiToken, Membership, Tenant
from runs.tokens import token_create

TENANT_NAME = "demo"


@dataclass(frozen=True)
class Account:
    username: str
    group: str = ""
    superuser: bool = False
    # Only accounts that sign in to the browser get a password; the agent
    # authenticates with its API token alone.
    signs_in: bool = True

    @property
    def env_var(self) -> str:
        return f"EXECGO_{self.username.upper()}_PASSWORD"

    @property
    def option(self) -> str:
        return f"{self.username}_password"


ACCOUNTS = (
    Account("admin", superuser=True),
    Account("approver", group="approvers"),
    Account("agent", group="agents", signs_in=False),
)


class Command(BaseCommand):
    help = (
        "Create (idempotently) the demo tenant, the users admin, approver (group approvers) and agent "
        "(group agents) and the agent's API token; print a new token's key as EXECGO_AGENT_TOKEN=<key> "
        "(once: only its digest is kept)."
    )

    def add_arguments(self, parser):
        for account in ACCOUNTS:
            if account.signs_in:
                parser.add_argument(
                    f"--{account.username}-password", dest=account.option, default=None,
                    help=f"password for {account.username!r} (default: ${account.env_var}; generated when "
                         "neither is set and the user has no password yet)",
                )

    def handle(self, *args, **options):
        lines: list[str] = []
        with transaction.atomic():
            tenant, created = Tenant.objects.get_or_create(name=TENANT_NAME)
            lines.append(f"tenant {tenant.name}: {'created' if created else 'exists'}")
            users = {}
            for account in ACCOUNTS:
                given = options.get(account.option) or os.environ.get(account.env_var) or None
                users[account.username], account_lines = self._ensure_account(account, tenant, given)
                lines.extend(account_lines)
            key = self._ensure_token(users["agent"])
            lines.append("agent token: created; its key is shown once" if key else
                         "agent token: exists (its key was shown when it was created; revoke it in the admin "
                         "and run this again for a new one)")
        # Printed only after commit: a token or password shown for rows that
        # rolled back would be a credential that does not exist.
        for line in lines:
            self.stdout.write(line)
        if key:
            self.stdout.write(f"EXECGO_AGENT_TOKEN={key}")

    @staticmethod
    def _ensure_token(agent) -> str:
        """A new token's key, or "" when the agent has a live one."""
        live = ApiToken.objects.filter(user=agent, revoked_at__isnull=True).filter(
            Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now()))
        if live.exists():
            return ""
        _token, key = token_create(user=agent, name="demo agent", caller="execgo_bootstrap")
        return key

    def _ensure_account(self, account: Account, tenant: Tenant, given: str | None):
        User = get_user_model()
        lines = []
        # make_password(None) is an unusable password: a new user has none
        # until one is given or generated below.
        user, created = User.objects.get_or_create(username=account.username,
                                                   defaults={"password": make_password(None)})
        lines.append(f"user {user.username}: {'created' if created else 'exists'}")

        # Flags are only ever raised: an operator who gave another account
        # more rights, or deactivated one, is not overruled on every start.
        flags = {"is_staff": True, "is_superuser": True} if account.superuser else {}
        changed = [name for name, value in flags.items() if getattr(user, name) != value]
        for name in changed:
            setattr(user, name, flags[name])

        if not account.signs_in:
            if user.has_usable_password():
                user.set_unusable_password()
                changed.append("password")
        elif given is not None:
            if not user.check_password(given):
                try:
                    validate_password(given, user)
                except ValidationError as exc:
                    raise CommandError(f"password for {user.username!r} rejected: {' '.join(exc.messages)}")
                user.set_password(given)
                changed.append("password")
                lines.append(f"{user.username}: password set from --{account.username}-password/"
                             f"{account.env_var}")
            else:
                lines.append(f"{user.username}: existing password kept (matches the one given)")
        elif user.has_usable_password():
            lines.append(f"{user.username}: existing password kept")
        else:
            generated = secrets.token_urlsafe(18)
            user.set_password(generated)
            changed.append("password")
            lines.append(f"{user.username}: password generated; it is shown once")
            lines.append(f"{account.env_var}={generated}")
        if changed:
            user.save(update_fields=changed)

        if account.group:
            group, _ = Group.objects.get_or_create(name=account.group)
            user.groups.add(group)

        membership, _ = Membership.objects.get_or_create(user=user, defaults={"tenant": tenant})
        if membership.tenant_id != tenant.pk:
            # Moving a user between tenants would hand it another tenant's
            # runs; that is an operator's decision, not a bootstrap's.
            raise CommandError(f"user {user.username!r} belongs to tenant {membership.tenant.name!r}, "
                               f"not {tenant.name!r}; refusing to move it")
        return user, lines
