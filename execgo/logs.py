"""Structured logs: JSON lines (or readable text in development) carrying
the ids of what is being handled, with secrets redacted.

The ids live in structlog's context variables, so every line a process
emits while it handles something carries them, whatever logger emitted it:

- ``RequestContextMiddleware`` binds ``request_id`` (the caller's
  ``X-Request-ID`` when it is a plain token, else a new one; echoed back),
  the caller's ``tenant_id`` and, on a run's URLs, its ``run_id``;
- a Celery task binds its ``task_name``, ``task_id`` and the ``run_id`` its
  arguments name (``task_prerun``; unbound at ``task_postrun``); the
  execution code binds ``step_id`` and ``handle_id`` where it knows them.

Every process imports this module through the LOGGING setting (it names the
formatters), which is also where the Celery signals are connected: a worker
configures logging before it runs a task.
"""

import logging
import logging.config
import re
import time
import uuid
from typing import Any

import structlog
from asgiref.sync import sync_to_async
from celery.signals import setup_logging, task_postrun, task_prerun
from structlog.contextvars import bind_contextvars, clear_contextvars, get_contextvars, merge_contextvars

from execgo.dual import SyncAndAsyncMiddleware

logger = logging.getLogger("execgo.request")

# --- Redaction -----------------------------------------------------------------

REDACTED = "[redacted]"
REQUEST_FIELDS = ("method", "path", "status", "duration_ms")
SECRET_KEYS = re.compile(r"(?i)^(authorization|cookie|set-cookie|password|passwd|secret|token|api_key|apikey|"
                         r"sessionid|csrftoken|csrfmiddlewaretoken|x-api-key)$")
SECRET_PATTERNS = [
    # An Authorization value: "Token 9944b0…", "Bearer eyJ…", "Basic dXNlcjpwdw=="
    (re.compile(r"(?i)\b(token|bearer|basic)(\s+)[A-Za-z0-9._~+/=-]{8,}"), r"\1\2" + REDACTED),
    # "Authorization: …", "Cookie: …", headers dumped as a dict or as lines
    (re.compile(r"(?i)\b(authorization|cookie|set-cookie|x-api-key)(['\"]?\s*[:=]\s*['\"]?)[^'\"\r\n]+"),
     r"\1\2" + REDACTED),
    # key=value and "key": "value" pairs (query strings, form bodies, reprs)
    (re.compile(r"(?i)\b(password|passwd|pwd|secret|token|api_key|apikey|access_token|sessionid|csrftoken|"
                r"csrfmiddlewaretoken|signature)(['\"]?\s*[:=]\s*['\"]?)[^\s&'\",;}]+"), r"\1\2" + REDACTED),
    # The password of a URL: postgres://user:pw@host, redis://:pw@host
    (re.compile(r"\b([a-z][a-z0-9+.-]*://[^/\s:@]*:)[^@\s/]+@"), r"\1" + REDACTED + "@"),
]


# Any word a pattern above starts from: most lines have none and cost one search.
SECRET_TRIGGER = re.compile(r"(?i)token|bearer|basic|authorization|cookie|api[-_]?key|passw|pwd|secret|session|"
                            r"csrf|signature|://")


def redact_text(text: str) -> str:
    if not SECRET_TRIGGER.search(text):
        return text
    for pattern, replacement in SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def _redact(value: Any) -> Any:
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {key: REDACTED if isinstance(key, str) and SECRET_KEYS.match(key) else _redact(item)
                for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_redact(item) for item in value]
    return value


def redact(_logger, _method, event_dict: dict) -> dict:
    """The last processor before rendering: every value, the traceback included."""
    return _redact(event_dict)


# --- Formatters (named by settings.LOGGING) --------------------------------------

def _pre_chain() -> list:
    return [
        merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        # Only these of a record's extra attributes: others hold objects (Django's request).
        structlog.stdlib.ExtraAdder(allow=REQUEST_FIELDS),
        structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp"),
        structlog.processors.CallsiteParameterAdder([structlog.processors.CallsiteParameter.PROCESS]),
    ]


def json_formatter() -> structlog.stdlib.ProcessorFormatter:
    return structlog.stdlib.ProcessorFormatter(foreign_pre_chain=_pre_chain(), processors=[
        structlog.stdlib.ProcessorFormatter.remove_processors_meta,
        structlog.processors.format_exc_info,
        redact,
        structlog.processors.JSONRenderer(default=str),
    ])


def text_formatter() -> structlog.stdlib.ProcessorFormatter:
    return structlog.stdlib.ProcessorFormatter(foreign_pre_chain=_pre_chain(), processors=[
        structlog.stdlib.ProcessorFormatter.remove_processors_meta,
        structlog.processors.format_exc_info,
        redact,
        structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback),
    ])


# --- Periodic tasks --------------------------------------------------------------

class QuietPeriodicTasks(logging.Filter):
    """Keeps the routine lines of periodic tasks off a handler unless the
    process logs at DEBUG: beat's "Sending due task" and a worker's
    "received" and "succeeded" of the tasks beat sends every few seconds
    (``settings.LOGGING`` names them), which would otherwise scroll everything else
    off a console. Their warnings and errors always pass."""

    def __init__(self, tasks=()):
        super().__init__()
        self.tasks = frozenset(tasks)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO or logging.getLogger().getEffectiveLevel() <= logging.DEBUG:
            return True
        if record.name == "celery.beat":
            args = record.args if isinstance(record.args, tuple) else ()
            return not any(arg in self.tasks for arg in args if isinstance(arg, str))
        if record.name in {"celery.worker.strategy", "celery.app.trace"} and isinstance(record.args, dict):
            return record.args.get("name") not in self.tasks
        return True


# --- Web requests ------------------------------------------------------------------

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def _may_be_signed_in(request) -> bool:
    from django.conf import settings

    return not request.META.get("HTTP_AUTHORIZATION") and settings.SESSION_COOKIE_NAME in request.COOKIES


def _tenant_id(request) -> int | None:
    """The tenant of a signed-in session, known before the view runs. A
    token's tenant is bound by the API's authentication, the one place that
    reads the token (``runs.api.authentication``): a token the view refuses
    leaves the line without one."""
    from runs.models import Membership

    if not _may_be_signed_in(request):
        return None
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return Membership.objects.filter(user=user).values_list("tenant_id", flat=True).first()
    return None


class RequestContextMiddleware(SyncAndAsyncMiddleware):
    """Binds the request's ids to every line logged while it is handled,
    echoes ``X-Request-ID`` and logs one line per request (method, path,
    status, duration; never the query string).

    Synchronous or asynchronous as the chain below it is: under Daphne the
    whole chain stays asynchronous down to the view (which Django runs in a
    thread, with these bindings copied in), so a middleware above it that
    waits (``execgo.auth.LoginThrottleMiddleware``) waits on the event loop."""

    def __init__(self, get_response):
        super().__init__(get_response)
        if self.is_async:
            # Django calls a synchronous process_view through the thread; this one does no I/O.
            self.process_view = self._process_view_async

    def __call__(self, request):
        if self.is_async:
            return self.__acall__(request)
        self._bind(request, _tenant_id(request))
        started = time.monotonic()
        return self._finish(request, self.get_response(request), started)

    async def __acall__(self, request):
        # No thread (nor query) for a request that carries no session.
        self._bind(request, await sync_to_async(_tenant_id)(request) if _may_be_signed_in(request) else None)
        started = time.monotonic()
        return self._finish(request, await self.get_response(request), started)

    @staticmethod
    def _bind(request, tenant_id: int | None) -> None:
        clear_contextvars()
        offered = request.META.get("HTTP_X_REQUEST_ID", "")
        request.request_id = offered if REQUEST_ID.match(offered) else uuid.uuid4().hex
        bind_contextvars(request_id=request.request_id)
        if tenant_id is not None:
            bind_contextvars(tenant_id=tenant_id)

    @staticmethod
    def _finish(request, response, started: float):
        response["X-Request-ID"] = request.request_id
        logger.info("%s %s %s", request.method, request.path, response.status_code, extra={
            "method": request.method, "path": request.path, "status": response.status_code,
            "duration_ms": round((time.monotonic() - started) * 1000, 3)})
        return response

    @staticmethod
    def _bind_run(view_kwargs) -> None:
        run_id = view_kwargs.get("run_id")
        if isinstance(run_id, int):
            bind_contextvars(run_id=run_id)

    def process_view(self, request, view_func, view_args, view_kwargs):
        self._bind_run(view_kwargs)

    async def _process_view_async(self, request, view_func, view_args, view_kwargs):
        self._bind_run(view_kwargs)


# --- Celery tasks --------------------------------------------------------------------

# Tasks whose first argument is a run's id.
RUN_TASKS = {"runs.tasks.advance_run", "runs.tasks.settle_run"}


# What was bound before each running task: a task run inline (eager mode,
# inside a request) gives the request its ids back when it ends.
_outer_context: dict[str, dict] = {}


@task_prerun.connect(weak=False)
def _bind_task(task_id=None, task=None, args=(), **_kwargs):
    _outer_context[task_id] = get_contextvars()
    clear_contextvars()
    bind_contextvars(task_name=task.name, task_id=task_id)
    if task.name in RUN_TASKS and args and isinstance(args[0], int):
        bind_contextvars(run_id=args[0])


@task_postrun.connect(weak=False)
def _unbind_task(task_id=None, **_kwargs):
    clear_contextvars()
    bind_contextvars(**_outer_context.pop(task_id, {}))


@setup_logging.connect(weak=False)
def _keep_django_logging(loglevel=None, **_kwargs):
    """A worker logs through settings.LOGGING too, not Celery's own
    handlers, at the level its command line asks for (``-l``)."""
    from django.conf import settings

    logging.config.dictConfig(settings.LOGGING)
    if loglevel:
        logging.getLogger().setLevel(loglevel)
