from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "runs"

    def ready(self) -> None:
        from django.db.backends.signals import connection_created

        # Registers the Celery tasks in every process, not only in workers:
        # the kernel sends them by name (runs.dispatch), and a process with
        # CELERY_TASK_ALWAYS_EAGER runs a task inline only if it has it.
        from runs import tasks  # noqa: F401
        from runs.audit import install_sqlite_guard

        # The SQLite trigger on AuditLog asks the connection whether a delete
        # is allowed: every connection gets the function it calls.
        connection_created.connect(install_sqlite_guard, dispatch_uid="execgo-audit-sqlite-guard")
