"""The LOGGING setting: where log lines go and in which format.

Only names here (formatters and the filter live in ``execgo/logs.py``):
this module is imported while the settings load, before Django is set up,
so it must import nothing that needs the settings.
"""

from typing import Any

from django.core.exceptions import ImproperlyConfigured

LOG_FORMATS = ("json", "text")


def logging_config(*, log_format: str, log_file: str, level: str,
                   beat_schedule: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """JSON lines or text on the console, and the same appended to
    ``log_file`` when one is named. An unknown format stops the start."""
    if log_format not in LOG_FORMATS:
        raise ImproperlyConfigured(f"EXECGO_LOG_FORMAT must be json or text, got {log_format!r}")
    handlers: dict[str, dict[str, Any]] = {
        "console": {"class": "logging.StreamHandler", "formatter": log_format, "filters": ["quiet_periodic_tasks"]},
    }
    if log_file:
        handlers["file"] = {"class": "logging.handlers.WatchedFileHandler", "filename": log_file,
                            "formatter": log_format}
    periodic_tasks = [*(entry["task"] for entry in beat_schedule.values()),
                      # fanned out one per host, by heal_ledgers and purge_expired_run_artifacts
                      "runs.tasks.heal_host", "runs.tasks.purge_host_artifacts"]
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": "execgo.logs.json_formatter"}, "text": {"()": "execgo.logs.text_formatter"}},
        # The console (what `make run` shows) leaves out the routine lines of the
        # periodic tasks at INFO; a log file keeps them.
        "filters": {"quiet_periodic_tasks": {"()": "execgo.logs.QuietPeriodicTasks", "tasks": periodic_tasks}},
        "handlers": handlers,
        "root": {"handlers": list(handlers), "level": level},
        "loggers": {"django.db.backends": {"level": "WARNING"}},
    }
