"""The test suite's settings: the project's own, with DEBUG off as in
production, and a secret key and host list of the suite's own. They go into
the environment, so every process a test starts (a worker, a web server,
``manage.py``) starts on them too."""

import os

os.environ.setdefault("DJANGO_SECRET_KEY", "execgo-test-suite-only-" + "0123456789abcdef" * 3)
os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,[::1],testserver")

from execgo.settings import *  # noqa: E402,F403
