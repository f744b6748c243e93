import os

from celery import Celery

from execgo.broker import use_atomic_filesystem_transport

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")
use_atomic_filesystem_transport()

app = Celery("execgo")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
