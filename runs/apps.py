from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "runs"

    def ready(self) -> None:
        # Registers the Celery tasks in every process, not only in workers:
        # the kernel sends them by name (runs.dispatch), and a process with
        # CELERY_TASK_ALWAYS_EAGER runs a task inline only if it has it.
        from django.contrib import admin

        from runs import tasks  # noqa: F401
        from runs.admin_scope import scope_site

        # The admin's own ready() has run (it comes first in INSTALLED_APPS)
        # and imported every app's admin module: close what nobody scoped.
        scope_site(admin.site)
