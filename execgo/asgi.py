import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402  (needs the apps loaded)
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

http_app = ASGIStaticFilesHandler(django_asgi_app) if settings.EXECGO_SERVE_STATIC else django_asgi_app

application = ProtocolTypeRouter({"http": http_app})
