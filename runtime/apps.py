from django.apps import AppConfig


class RuntimeConfig(AppConfig):
    name = "runtime"
    verbose_name = "Runtime (execution data plane)"
