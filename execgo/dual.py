"""The base of a middleware that is synchronous or asynchronous as the
chain below it is: under Daphne it stays on the event loop, under WSGI it
runs in the request's thread. A subclass's ``__call__`` hands over to its
``__acall__`` when ``is_async``."""

from asgiref.sync import iscoroutinefunction, markcoroutinefunction


class SyncAndAsyncMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)
