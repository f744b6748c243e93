"""Beat's scheduler: django-celery-beat's database scheduler, whose ``sync``
never raises.

Beat saves its schedule from its SIGTERM/SIGINT handler and only then raises
``SystemExit`` (``celery.apps.beat``). The handler runs wherever the signal
lands, a database call of the scheduler's own included; when that save
raised there (``Cannot operate on a closed database`` on SQLite), the
exception replaced the ``SystemExit``, beat's loop logged it as a failed
send and went on, and beat ran until its supervisor SIGKILLed it. Losing
the last run times of one beat is harmless: an entry is at most sent again
a little early.
"""

import logging

from django_celery_beat.schedulers import DatabaseScheduler

logger = logging.getLogger(__name__)


class Scheduler(DatabaseScheduler):
    def sync(self) -> None:
        try:
            super().sync()
        except Exception:  # noqa: BLE001 - see the module's docstring
            logger.warning("beat: the schedule's last run times were not saved", exc_info=True)
