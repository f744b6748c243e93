"""Authentication backends."""

from axes.backends import AxesStandaloneBackend


class LoginRateLimitBackend(AxesStandaloneBackend):
    """django-axes' lockout check, for logins that come with a request.

    ``authenticate()`` without a request comes from code on this machine
    (a management command, a test client's ``login``), never from the
    network, so there is nothing to rate-limit and it passes through.
    """

    def authenticate(self, request, username=None, password=None, **kwargs):
        if request is None:
            return None
        return super().authenticate(request, username=username, password=password, **kwargs)
