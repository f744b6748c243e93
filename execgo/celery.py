import os

from celery import Celery

from execgo.broker import use_atomic_filesystem_transport
from execgo.redis_broker import use_guarded_redis_transport

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")
use_atomic_filesystem_transport()
use_guarded_redis_transport()

app = Celery("execgo")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
