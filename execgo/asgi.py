import os

from django.core.asgi import get_asgi_application

from execgo.databases import use_a_pool

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")
use_a_pool()  # before the settings load: this process serves requests from many threads
django_asgi_app = get_asgi_application()

# The rest needs the apps loaded.
from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.urls import re_path  # noqa: E402

from pages.routing import websocket_urlpatterns  # noqa: E402
from runs.api.routing import waiting_urlpatterns  # noqa: E402

http_app = ASGIStaticFilesHandler(django_asgi_app) if settings.EXECGO_SERVE_STATIC else django_asgi_app

application = ProtocolTypeRouter({
    # The API's waiting endpoints first (they bypass Django's middleware), then Django.
    "http": URLRouter([*waiting_urlpatterns, re_path(r"", http_app)]),
    # The session authenticates a websocket; its Origin must be one of
    # ALLOWED_HOSTS (no cross-site websocket hijacking).
    "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
})
