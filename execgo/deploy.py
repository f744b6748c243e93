"""The two settings a deployment must set itself: the secret key and the
host names. Outside debug mode the process refuses to start without them,
instead of running on the development key or on a guessed host list (fails
closed); in debug mode they fall back to development values.
"""

from django.core.exceptions import ImproperlyConfigured

DEVELOPMENT_SECRET_KEY = "execgo-insecure-development-key-change-me"
DEVELOPMENT_HOSTS = ["localhost", "127.0.0.1", "[::1]", "testserver"]


def secret_key(configured: str, *, debug: bool) -> str:
    """DJANGO_SECRET_KEY, required outside debug mode."""
    if not debug and not configured:
        raise ImproperlyConfigured("Set DJANGO_SECRET_KEY to a long random string (or DJANGO_DEBUG=true for development).")
    return configured or DEVELOPMENT_SECRET_KEY


def allowed_hosts(configured: list[str], *, debug: bool) -> list[str]:
    """DJANGO_ALLOWED_HOSTS, required outside debug mode."""
    if not debug and not configured:
        raise ImproperlyConfigured(
            "Set DJANGO_ALLOWED_HOSTS to the host names the site answers to (or DJANGO_DEBUG=true for development)."
        )
    return configured or list(DEVELOPMENT_HOSTS)
