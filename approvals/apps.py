from django.apps import AppConfig


class ApprovalsConfig(AppConfig):
    name = "approvals"

    def ready(self) -> None:
        # Registers the approvals' Celery tasks in every process (they are sent
        # by name; CELERY_TASK_ALWAYS_EAGER runs a task inline only if it is known).
        from approvals import tasks  # noqa: F401
