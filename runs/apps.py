from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "runs"

    def ready(self) -> None:
        # Registers the Celery tasks in every process, not only in workers:
        # the kernel sends them by name (runs.dispatch), and a process with
        # CELERY_TASK_ALWAYS_EAGER runs a task inline only if it has it.
        from django.contrib import admin
        from django.db.backends.signals import connection_created

        from runs import checks, tasks  # noqa: F401
        from runs.admin_scope import scope_site

        # The admin's own ready() has run (it comes first in INSTALLED_APPS)
        # and imported every app's admin module: close what nobody scoped.
        scope_site(admin.site)

        from runs.audit import install_sqlite_guard

        # The SQLite trigger on AuditLog asks the connection whether a delete
        # is allowed: every connection gets the function it calls.
        connection_created.connect(install_sqlite_guard, dispatch_uid="execgo-audit-sqlite-guard")

        from django.contrib.auth import get_user_model
        from django.db.models.signals import pre_delete

        from runs.tokens import revoke_tokens_of_deleted_user

        pre_delete.connect(revoke_tokens_of_deleted_user, sender=get_user_model(),
                           dispatch_uid="execgo-revoke-deleted-users-tokens")

        from runs.sessions import connect_signals

        # Tells the live pages' websockets to check their sessions again.
        connect_signals()
