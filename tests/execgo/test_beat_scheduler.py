"""Beat stops on SIGTERM/SIGINT even when saving its schedule fails there:
its signal handler saves the schedule and only then raises SystemExit, and
an error in the save (the signal having landed in a database call of the
scheduler's own) was swallowed by beat's loop, which ran on until its
supervisor SIGKILLed it."""

import signal
import sqlite3

import pytest
from celery import platforms
from celery.apps.beat import Beat
from django_celery_beat.schedulers import DatabaseScheduler

from execgo.beat_scheduler import Scheduler
from execgo.celery import app

pytestmark = pytest.mark.stack_free


class Service:
    def __init__(self, scheduler):
        self.scheduler = scheduler

    def sync(self):
        self.scheduler.sync()


def failing_save(self):
    raise sqlite3.ProgrammingError("Cannot operate on a closed database.")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_the_stop_signal_ends_beat_when_its_schedule_cannot_be_saved(monkeypatch, signum):
    monkeypatch.setattr(DatabaseScheduler, "sync", failing_save)
    handlers = {}
    monkeypatch.setattr(platforms.signals, "update", lambda **named: handlers.update(named))
    Beat(app=app).install_sync_handler(Service(Scheduler.__new__(Scheduler)))

    with pytest.raises(SystemExit):
        handlers[signal.Signals(signum).name](signum, None)


def test_without_it_the_error_replaces_the_exit(monkeypatch):
    """What happened with django-celery-beat's own scheduler."""
    monkeypatch.setattr(DatabaseScheduler, "sync", failing_save)
    handlers = {}
    monkeypatch.setattr(platforms.signals, "update", lambda **named: handlers.update(named))
    Beat(app=app).install_sync_handler(Service(DatabaseScheduler.__new__(DatabaseScheduler)))

    with pytest.raises(sqlite3.ProgrammingError):
        handlers["SIGTERM"](signal.SIGTERM, None)


def test_the_project_runs_this_scheduler(settings):
    assert settings.CELERY_BEAT_SCHEDULER == "execgo.beat_scheduler:Scheduler"
