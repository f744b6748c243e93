"""ExecGo settings, read from the environment.

With no environment at all ExecGo runs on an embedded default that needs no
services: SQLite (WAL) and Celery's filesystem broker under EXECGO_DATA_DIR.
Production sets DATABASE_URL=postgres://… and CELERY_BROKER_URL=redis://….
What is built rather than listed (DATABASES, LOGGING, beat's schedule, the
REST framework's settings, a step's default limits) comes from the modules below.
It stays over 400 lines because it is the one list of every setting, each
with the comment an operator reads (the README's Configuration table is
checked against it).
"""

import os
import sys
from datetime import timedelta
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from execgo.api_config import api_schema, rest_framework
from execgo.beat import beat_schedule
from execgo.broker import filesystem_transport_options
from execgo.databases import databases
from execgo.deploy import allowed_hosts, secret_key
from execgo.env import env_bool, env_float, env_int, env_list, env_str
from execgo.logging_config import logging_config
from execgo.sandbox_defaults import default_limits, etc_secret_paths, limit_caps, readonly_paths

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = Path(env_str("EXECGO_DATA_DIR", str(BASE_DIR / "var"))).resolve()
DATA_DIR.mkdir(parents=True, exist_ok=True)

DEBUG = env_bool("DJANGO_DEBUG", False)
# Fails closed: required outside debug mode (execgo/deploy.py).
SECRET_KEY = secret_key(env_str("DJANGO_SECRET_KEY", "").strip(), debug=DEBUG)
ALLOWED_HOSTS = allowed_hosts(env_list("DJANGO_ALLOWED_HOSTS", []), debug=DEBUG)
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS", [])

# Daphne serves the ASGI application as a program of its own (the Procfile);
# it is not an app here, since its app only adds an ASGI ``runserver`` and
# would load Twisted into every worker and management command.
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "template_partials",
    "axes",
    "django_celery_beat",
    "channels",
    # The project's apps, the lowest first: the data plane, the kernel, then what stands on it.
    *("runtime", "runs", "policy", "approvals", "pages"),
]

# Django's common, authentication and messages middleware, with the
# hooks that do no I/O kept on the event loop under ASGI (execgo/middleware.py).
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Before the session and the view: it may hold a login POST back (execgo/auth.py).
    "execgo.auth.LoginThrottleMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "execgo.middleware.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "execgo.middleware.AuthenticationMiddleware",
    # After the session: a session a decision link opened is good for that link only.
    "execgo.middleware.DecisionLinkSessionMiddleware",
    # After authentication: binds the request id and the caller's tenant to every log line.
    "execgo.logs.RequestContextMiddleware",
    "execgo.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last: it answers a locked-out login with the lockout page.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "execgo.urls"
WSGI_APPLICATION = "execgo.wsgi.application"
ASGI_APPLICATION = "execgo.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "pages.context.navigation",
            ],
        },
    },
]

# --- Database -------------------------------------------------------------

# "default", and "audit": a second connection to it for the audit rows that
# must outlive the caller's rollback; SQLite tuned for concurrent writers.
DATABASE_URL = env_str("DATABASE_URL", f"sqlite:///{DATA_DIR / 'execgo.sqlite3'}")
DATABASES = databases(DATABASE_URL, conn_max_age=env_int("DATABASE_CONN_MAX_AGE", 300),
                      pool_size=env_int("DATABASE_POOL_MAX_SIZE", 8), data_dir=DATA_DIR)
DATABASE_ROUTERS: list[str] = []
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
IS_SQLITE = DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3"

# --- Auth, i18n, static ---------------------------------------------------

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
AUTHENTICATION_BACKENDS = [
    "execgo.auth.LoginRateLimitBackend",  # first: a locked-out login is refused before any password check
    "django.contrib.auth.backends.ModelBackend",
]
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"
# Login rate limit (django-axes): this many failures for one username from
# one address lock that pair out for the cool-off time. Never the username
# alone (anyone could lock an approver out): failures for one username from
# many addresses slow its logins down instead (execgo/auth.py).
AXES_FAILURE_LIMIT = env_int("EXECGO_LOGIN_FAILURE_LIMIT", 5)
AXES_COOLOFF_TIME = timedelta(seconds=env_int("EXECGO_LOGIN_COOLOFF_S", 900))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
# The TCP peer, or behind these proxies what they appended to X-Forwarded-For
# (never what a client wrote there); spelled out so that installing
# django-ipware could never make the header believed.
AXES_CLIENT_IP_CALLABLE = "execgo.auth.client_address"
EXECGO_TRUSTED_PROXIES = env_list("EXECGO_TRUSTED_PROXIES", [])
EXECGO_LOGIN_THROTTLE_AFTER = env_int("EXECGO_LOGIN_THROTTLE_AFTER", 10)
EXECGO_LOGIN_THROTTLE_MAX_S = env_float("EXECGO_LOGIN_THROTTLE_MAX_S", 2.0)
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_TEMPLATE = "registration/lockout.html"
AXES_VERBOSE = False
# Session and CSRF cookies: never readable by scripts; sent over HTTPS only
# when the site is served over HTTPS (EXECGO_HTTPS, set it in production).
EXECGO_HTTPS = env_bool("EXECGO_HTTPS", False)
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
SESSION_COOKIE_AGE = env_int("EXECGO_SESSION_AGE_S", 12 * 3600)
SESSION_COOKIE_SECURE = EXECGO_HTTPS
CSRF_COOKIE_HTTPONLY = True
CSRF_COOKIE_SECURE = EXECGO_HTTPS
# Served over HTTPS: plain HTTP is redirected and browsers are told (HSTS)
# to use HTTPS only. Behind a TLS-terminating proxy, Django sees plain HTTP:
# EXECGO_PROXY_SSL_HEADER names the header the proxy sets to "https" (the
# proxy must overwrite it on every request, or a client could forge it).
# The probes stay reachable over plain HTTP for a load balancer.
SECURE_SSL_REDIRECT = env_bool("EXECGO_SSL_REDIRECT", EXECGO_HTTPS)
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$"]
SECURE_HSTS_SECONDS = env_int("EXECGO_HSTS_SECONDS", 365 * 24 * 3600 if EXECGO_HTTPS else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("EXECGO_HSTS_INCLUDE_SUBDOMAINS", True)
SECURE_HSTS_PRELOAD = env_bool("EXECGO_HSTS_PRELOAD", False)
_proxy_ssl_header = env_str("EXECGO_PROXY_SSL_HEADER", "")
if _proxy_ssl_header:
    SECURE_PROXY_SSL_HEADER = ("HTTP_" + _proxy_ssl_header.upper().replace("-", "_"), "https")
CSRF_FAILURE_VIEW = "django.views.csrf.csrf_failure"
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = DATA_DIR / "static"
# The embedded default serves its own static files (admin CSS, dashboard JS);
# behind a reverse proxy, turn this off and serve STATIC_ROOT from there.
EXECGO_SERVE_STATIC = env_bool("EXECGO_SERVE_STATIC", True)
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("EXECGO_MAX_REQUEST_BYTES", 1024 * 1024)

# --- REST API ---------------------------------------------------------------

# Over the size limit (DATA_UPLOAD_MAX_MEMORY_SIZE above) a body is 413;
# deeper than this its JSON is refused before it is decoded.
EXECGO_API_MAX_JSON_DEPTH = env_int("EXECGO_API_MAX_JSON_DEPTH", 64)
# Longest long-poll of GET runs/{id}/events (a larger ?wait= waits this long).
EXECGO_API_LONG_POLL_MAX_S = env_float("EXECGO_API_LONG_POLL_MAX_S", 30.0)
# Longest GET runs/{id}/wait (a larger ?timeout= waits this long).
EXECGO_API_WAIT_MAX_S = env_float("EXECGO_API_WAIT_MAX_S", 60.0)
# Requests per authenticated user (DRF rate syntax: N/second|minute|hour|day;
# empty: no throttling). Counted per web process (the local-memory cache).
EXECGO_API_THROTTLE_RATE = env_str("EXECGO_API_THROTTLE_RATE", "1200/minute") or None

REST_FRAMEWORK = rest_framework(throttle_rate=EXECGO_API_THROTTLE_RATE)
SPECTACULAR_SETTINGS = api_schema()

# --- Celery -----------------------------------------------------------------

CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", "filesystem://")
if CELERY_BROKER_URL.startswith("filesystem://"):
    CELERY_BROKER_TRANSPORT_OPTIONS = filesystem_transport_options(
        DATA_DIR / "broker", polling_interval=env_float("EXECGO_BROKER_POLL_S", 0.05))
else:
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        # Longer than the longest task, or Redis redelivers it while it runs.
        "visibility_timeout": env_int("CELERY_VISIBILITY_TIMEOUT", 4 * 3600),
        # A publish whose broker is down gives up after one immediate reconnect
        # (kombu's default retries for about 6 s, and a submit waited that
        # long): what it sends is in the dispatch outbox, relayed once the
        # broker is back (runs/dispatch.py). A worker's consumer reconnects
        # with its own retries (broker_connection_max_retries).
        "max_retries": 1, "interval_start": 0,
    }
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_IGNORE_RESULT = True
# Celery closes a worker's database connections after every task unless told
# to reuse them: they are kept (DATABASE_CONN_MAX_AGE), checked before each
# task (runs/tasks.py), and closed all the same every this many tasks.
CELERY_DB_REUSE_MAX = 1000
CELERY_RESULT_BACKEND = None
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# A pool process that dies mid-task (OOM killer, kill -9) holds its prefetch
# slot until its job is declared lost: Celery waits 10 s for a late result
# by default, and the worker takes no new message meanwhile. The tasks are
# idempotent and fenced and their results ignored, so one second is enough.
CELERY_WORKER_LOST_WAIT = env_float("CELERY_WORKER_LOST_WAIT", 1.0)
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)
CELERY_BEAT_SCHEDULER = "execgo.beat_scheduler:Scheduler"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
EXECGO_DEADLINE_SCAN_INTERVAL_S = env_float("EXECGO_DEADLINE_SCAN_INTERVAL_S", 2.0)
EXECGO_LEDGER_HEAL_INTERVAL_S = env_float("EXECGO_LEDGER_HEAL_INTERVAL_S", 5.0)
EXECGO_GC_INTERVAL_S = float(env_int("EXECGO_GC_INTERVAL_S", 3600))
CELERY_BEAT_SCHEDULE = beat_schedule(
    sweep_s=float(env_int("EXECGO_SWEEP_INTERVAL_S", 30)), gc_s=EXECGO_GC_INTERVAL_S,
    deadline_scan_s=EXECGO_DEADLINE_SCAN_INTERVAL_S,
    dispatch_relay_s=env_float("EXECGO_DISPATCH_RELAY_INTERVAL_S", 1.0),
    ledger_heal_s=EXECGO_LEDGER_HEAL_INTERVAL_S,
    notify_relay_s=float(env_int("EXECGO_NOTIFY_RELAY_INTERVAL_S", 60)),
    reminder_scan_s=env_float("EXECGO_REMINDER_SCAN_INTERVAL_S", 5.0),
)
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# --- Channels -------------------------------------------------------------

REDIS_URL = env_str("REDIS_URL", "")
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [REDIS_URL]}}
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
# The live pages' groups: each web process tails the outbox itself and sends
# to its own websockets, so this layer never crosses processes (runs/relay.py).
CHANNEL_LAYERS["relay"] = {"BACKEND": "channels.layers.InMemoryChannelLayer"}
# How often the relay reads the outbox when nothing woke it (PostgreSQL
# wakes it by NOTIFY at every commit), how often while it waits on a hole
# in the ids, and how long a hole may stay before it counts as a rollback.
EXECGO_RELAY_POLL_S = env_float("EXECGO_RELAY_POLL_S", 0.05 if IS_SQLITE else 1.0)
EXECGO_RELAY_HOLE_POLL_S = env_float("EXECGO_RELAY_HOLE_POLL_S", 0.02)
EXECGO_RELAY_GAP_WAIT_S = env_float("EXECGO_RELAY_GAP_WAIT_S", 2.0)
# How often a live page's websocket checks that its session still holds
# (one query; a logout, a password change, a deactivation or a membership
# change also wakes it at once where the change reaches its process).
EXECGO_WS_RECHECK_S = env_float("EXECGO_WS_RECHECK_S", 1.0)

# --- ExecGo -----------------------------------------------------------------

EXECGO_RUN_TIMEOUT_S = env_int("EXECGO_RUN_TIMEOUT_S", 600)
EXECGO_APPROVAL_TIMEOUT_S = env_int("EXECGO_APPROVAL_TIMEOUT_S", 24 * 3600)
# The longest text (a script, stdin, a body, a file's content) an approval shows whole; a longer one
# makes its step at least high ("too large to review").
EXECGO_APPROVAL_SHOW_MAX_BYTES = env_int("EXECGO_APPROVAL_SHOW_MAX_BYTES", 64 * 1024)
EXECGO_STEP_TIMEOUT_S = env_float("EXECGO_STEP_TIMEOUT_S", 60.0)
EXECGO_MAX_PLAN_STEPS = env_int("EXECGO_MAX_PLAN_STEPS", 200)
EXECGO_OUTPUT_TAIL_BYTES = env_int("EXECGO_OUTPUT_TAIL_BYTES", 64 * 1024)
EXECGO_TASKS_DIR = DATA_DIR / "tasks"
# Workspaces and logs of final runs are purged this long after they ended.
EXECGO_TASK_RETENTION_S = env_int("EXECGO_TASK_RETENTION_S", 7 * 24 * 3600)
# The execution data plane of this worker host.
EXECGO_HOST_NAME = env_str("EXECGO_HOST_NAME", "")  # empty: the machine's hostname
# A tenant's audit rows written with their callers' transactions chain in this
# many lanes on PostgreSQL (runs.audit): a writer takes a lane no other
# transaction holds, so one tenant's writers do not queue on one chain head.
EXECGO_AUDIT_LANES = env_int("EXECGO_AUDIT_LANES", 32)
# Steps a host runs at once (the resource ledger's slots). A step waiting on its
# shim holds no worker process (EXECGO_STEP_HAND_OFF_S) and no CPU, so the
# default is many per CPU: 0 means EXECGO_TASK_SLOTS_PER_CPU for each CPU.
EXECGO_TASK_SLOTS = env_int("EXECGO_TASK_SLOTS", 0)
EXECGO_TASK_SLOTS_PER_CPU = env_int("EXECGO_TASK_SLOTS_PER_CPU", 16)
# A pool process waits this long for the shim it launched, then hands the step
# to its worker's watcher (runtime.watcher) and takes other work; negative:
# never (the pool process waits for every step to its end).
EXECGO_STEP_HAND_OFF_S = env_float("EXECGO_STEP_HAND_OFF_S", 0.015)
EXECGO_MEMORY_BYTES = env_int("EXECGO_MEMORY_BYTES", 0)  # 0: the machine's memory
EXECGO_PIDS_CAPACITY = env_int("EXECGO_PIDS_CAPACITY", 4096)
# A step waits this long in its worker process for a free slot, then goes
# back to the queue with a countdown of about EXECGO_LEDGER_REQUEUE_S.
EXECGO_LEDGER_WAIT_S = env_float("EXECGO_LEDGER_WAIT_S", 1.0)
EXECGO_LEDGER_REQUEUE_S = env_float("EXECGO_LEDGER_REQUEUE_S", 0.5)
# An attempt that failed before anything ran (claimed, never started) is
# retried up to this many times beyond the step's own retries.
EXECGO_UNSTARTED_RETRIES = env_int("EXECGO_UNSTARTED_RETRIES", 2)
# Past a run's deadline by this much with a step still in flight, the
# deadline scan ends the run without waiting for that step's executor.
EXECGO_DEADLINE_GRACE_S = env_float("EXECGO_DEADLINE_GRACE_S", 3.0)
EXECGO_SANDBOX_MODE = env_str("EXECGO_SANDBOX_MODE", "adaptive")  # strict | adaptive, when a step says neither
if EXECGO_SANDBOX_MODE not in {"strict", "adaptive"}:
    raise ImproperlyConfigured(f"EXECGO_SANDBOX_MODE must be strict or adaptive, got {EXECGO_SANDBOX_MODE!r}")
# A root worker runs every shell step as its own unprivileged uid, taken from
# [EXECGO_SANDBOX_UID, EXECGO_SANDBOX_UID + EXECGO_SANDBOX_UID_COUNT) by the
# step's id: steps cannot read each other's files, signal each other or share
# a process limit ("none": never drop, and no step is contained by uid).
_sandbox_uid = env_str("EXECGO_SANDBOX_UID", "1000000")
EXECGO_SANDBOX_UID = None if _sandbox_uid.lower() == "none" else env_int("EXECGO_SANDBOX_UID", 1000000)
EXECGO_SANDBOX_UID_COUNT = env_int("EXECGO_SANDBOX_UID_COUNT", 1000000)
# A contained step sees only the host's system directories (/usr, /bin,
# /sbin, /lib*, /etc; see runtime/sandbox.py). Paths in them it must not
# read: a directory gets an empty tmpfs over it, a file an empty one nobody
# may read (the data and tasks directories are always hidden). The default:
# /etc's secrets (execgo/sandbox_defaults.py); paths this host lacks are skipped.
EXECGO_SANDBOX_HIDDEN_PATHS = env_list("EXECGO_SANDBOX_HIDDEN_PATHS", etc_secret_paths())
# Host paths an operator shows every contained step, read-only (a tool
# directory under /opt, say): recorded in each step's plan and rating risk
# medium there. Absolute, never /, the data or tasks directory, or above them.
EXECGO_SANDBOX_READONLY_PATHS = readonly_paths(env_list("EXECGO_SANDBOX_READONLY_PATHS", []), data_dir=DATA_DIR,
                                               tasks_dir=EXECGO_TASKS_DIR)
# Network of a step that asks for "internet": a user-mode NAT that cannot
# reach the host's loopback (pasta, of Debian's passt); empty: pasta on PATH.
EXECGO_PASTA_PATH = env_str("EXECGO_PASTA_PATH", "")
EXECGO_BWRAP_PATH = env_str("EXECGO_BWRAP_PATH", "")  # empty: bwrap on PATH
EXECGO_UNSHARE_PATH = env_str("EXECGO_UNSHARE_PATH", "/usr/bin/unshare")
EXECGO_SHIM_FORKSERVER = env_bool("EXECGO_SHIM_FORKSERVER", True)
# Idle seconds after which the shim fork server exits (the next step starts a new one).
EXECGO_SHIM_FORKSERVER_IDLE_S = env_float("EXECGO_SHIM_FORKSERVER_IDLE_S", 600.0)
# The interpreter that runs the shim (started with -I -S: no site, no environment).
EXECGO_SHIM_PYTHON = env_str("EXECGO_SHIM_PYTHON", sys.executable)
# On timeout or cancel: seconds between SIGTERM and SIGKILL of a step's
# processes, and for draining their output pipes afterwards.
EXECGO_KILL_GRACE_S = env_float("EXECGO_KILL_GRACE_S", 0.5)
EXECGO_DRAIN_GRACE_S = env_float("EXECGO_DRAIN_GRACE_S", 0.2)
# A waiter kills a shim this long after the step's own timeout and grace
# (the shim enforces the timeout itself; this is the backstop).
EXECGO_SHIM_BACKSTOP_S = env_float("EXECGO_SHIM_BACKSTOP_S", 30.0)
# A script step runs as [EXECGO_SHELL, "-c", script]; every shell step gets EXECGO_SHELL_PATH as PATH.
EXECGO_SHELL = env_str("EXECGO_SHELL", "/bin/sh")
EXECGO_SHELL_PATH = env_str("EXECGO_SHELL_PATH", "/usr/local/bin:/usr/bin:/bin")
# Limits of every step, and the most a step may ask for (execgo/sandbox_defaults.py).
EXECGO_DEFAULT_LIMITS = default_limits()
EXECGO_LIMIT_CAPS = limit_caps()
EXECGO_SHELL_ENV_ALLOWLIST = env_list(
    "EXECGO_SHELL_ENV_ALLOWLIST", ["LANG", "LANGUAGE", "LC_*", "TZ", "TERM", "NO_COLOR", "STEP_*"]
)
EXECGO_FILE_MAX_BYTES = env_int("EXECGO_FILE_MAX_BYTES", 8 * 1024 * 1024)
EXECGO_HTTP_MAX_BODY_BYTES = env_int("EXECGO_HTTP_MAX_BODY_BYTES", 1024 * 1024)
# Runs an http step's request as the step's uid (stdlib only, -I -S): an
# interpreter that uid can execute (a virtualenv under /root is not one).
EXECGO_HTTP_HELPER_PYTHON = env_str(
    "EXECGO_HTTP_HELPER_PYTHON", "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
)
# CAs an https request trusts besides the system's (a PEM file, e.g. an
# internal CA): the worker reads it, the request's process gets its text.
EXECGO_HTTP_CA_BUNDLE = env_str("EXECGO_HTTP_CA_BUNDLE", "")

# A sweep that finds more stuck runs than this hands each to the workers (a task a run).
EXECGO_SWEEP_INLINE_MAX = env_int("EXECGO_SWEEP_INLINE_MAX", 20)
# Policy gate: run budgets (exceeding one rejects the run) and the hosts an
# http step may write to without an approval.
EXECGO_BUDGET_MAX_STEPS = env_int("EXECGO_BUDGET_MAX_STEPS", 100)
EXECGO_BUDGET_MAX_RUN_SECONDS = env_int("EXECGO_BUDGET_MAX_RUN_SECONDS", 3600)
EXECGO_BUDGET_MAX_CPU_SECONDS = env_int("EXECGO_BUDGET_MAX_CPU_SECONDS", 600)
EXECGO_BUDGET_MAX_HTTP_CALLS = env_int("EXECGO_BUDGET_MAX_HTTP_CALLS", 50)
EXECGO_BUDGET_MAX_COMMAND_CHARS = env_int("EXECGO_BUDGET_MAX_COMMAND_CHARS", 8192)
EXECGO_HTTP_ALLOWED_HOSTS = env_list("EXECGO_HTTP_ALLOWED_HOSTS", [])
# Internal networks (CIDRs) an http step may reach at all; see runtime/egress.py.
EXECGO_HTTP_ALLOWED_NETWORKS = env_list("EXECGO_HTTP_ALLOWED_NETWORKS", [])
# The hosts a run's callback_url may name (empty: no callbacks).
EXECGO_CALLBACK_ALLOWED_HOSTS = env_list("EXECGO_CALLBACK_ALLOWED_HOSTS", [])

# The llm planner: an OpenAI-compatible chat-completions endpoint.
EXECGO_LLM_URL = env_str("EXECGO_LLM_URL", "")
EXECGO_LLM_MODEL = env_str("EXECGO_LLM_MODEL", "")
EXECGO_LLM_API_KEY = env_str("EXECGO_LLM_API_KEY", "")
EXECGO_LLM_TIMEOUT_S = env_float("EXECGO_LLM_TIMEOUT_S", 30.0)
EXECGO_LLM_RETRIES = env_int("EXECGO_LLM_RETRIES", 2)
EXECGO_LLM_BACKOFF_S = env_float("EXECGO_LLM_BACKOFF_S", 0.5)
EXECGO_CONTEXT_BUDGET_BYTES = env_int("EXECGO_CONTEXT_BUDGET_BYTES", 64 * 1024)
EXECGO_MEMORY_RECALL_LIMIT = env_int("EXECGO_MEMORY_RECALL_LIMIT", 50)
EXECGO_MEMORY_OUTPUT_BYTES = env_int("EXECGO_MEMORY_OUTPUT_BYTES", 1024)
# Outgoing webhooks (runs/webhooks.py): signed with their tenant's own secret
# (Tenant.webhook_secret, in the admin; the one shared EXECGO_WEBHOOK_SECRET
# is retired), retried with exponential backoff. Approval notifications are
# sent only when the URL is set.
EXECGO_APPROVAL_WEBHOOK_URL = env_str("EXECGO_APPROVAL_WEBHOOK_URL", "")
if EXECGO_APPROVAL_WEBHOOK_URL and not EXECGO_APPROVAL_WEBHOOK_URL.startswith(("http://", "https://")):
    raise ImproperlyConfigured("EXECGO_APPROVAL_WEBHOOK_URL must be an http:// or https:// URL")
EXECGO_WEBHOOK_TIMEOUT_S = env_float("EXECGO_WEBHOOK_TIMEOUT_S", 5.0)
EXECGO_WEBHOOK_MAX_ATTEMPTS = env_int("EXECGO_WEBHOOK_MAX_ATTEMPTS", 8)
if EXECGO_WEBHOOK_MAX_ATTEMPTS < 1:
    raise ImproperlyConfigured(f"EXECGO_WEBHOOK_MAX_ATTEMPTS must be at least 1, got {EXECGO_WEBHOOK_MAX_ATTEMPTS}")
EXECGO_WEBHOOK_BACKOFF_S = env_float("EXECGO_WEBHOOK_BACKOFF_S", 1.0)
# Seconds a run may stay in a state before the zombie sweeper closes it
# (AWAITING_HITL and EXECUTING use the run's own approval and run timeouts).
EXECGO_ZOMBIE_THRESHOLDS_S = {
    "CREATED": env_int("EXECGO_ZOMBIE_CREATED_S", 30),
    "PREPARING": env_int("EXECGO_ZOMBIE_PREPARING_S", 60),
    "PLANNING": env_int("EXECGO_ZOMBIE_PLANNING_S", 180),
    "POLICY_CHECK": env_int("EXECGO_ZOMBIE_POLICY_CHECK_S", 30),
    "TRACING": env_int("EXECGO_ZOMBIE_TRACING_S", 60),
    "TRANSIENT": env_int("EXECGO_ZOMBIE_TRANSIENT_S", 30),
    # An EXECUTING run with no step running and nothing moving for this long is sent its queued work again.
    "EXECUTING_IDLE": env_int("EXECGO_ZOMBIE_EXECUTING_IDLE_S", 30),
}
# How many times the sweeper sends a stuck run's work again before it fails the run.
EXECGO_SWEEP_RESENDS = env_int("EXECGO_SWEEP_RESENDS", 3)
# --- Approvers' notifications (docs/approvals.md#notifications) -------------
# Where ExecGo's pages are, for the links in messages.
EXECGO_PUBLIC_URL = env_str("EXECGO_PUBLIC_URL", "http://127.0.0.1:8000")
# E-mail: Django's mail framework. The console backend prints messages (make
# run); production sets the SMTP backend and its server.
EMAIL_BACKEND = env_str("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
EMAIL_USE_SSL = env_bool("EMAIL_USE_SSL", False)
EMAIL_TIMEOUT = env_int("EMAIL_TIMEOUT", 10)
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "ExecGo <execgo@localhost>")
# Chat: the hosts an approver's incoming-webhook URL may name (".example.com"
# also allows its subdomains).
EXECGO_CHAT_WEBHOOK_HOSTS = env_list("EXECGO_CHAT_WEBHOOK_HOSTS", ["hooks.slack.com", ".webhook.office.com"])
EXECGO_NOTIFY_MAX_ATTEMPTS = env_int("EXECGO_NOTIFY_MAX_ATTEMPTS", 5)
EXECGO_NOTIFY_RETRY_BASE_S = env_float("EXECGO_NOTIFY_RETRY_BASE_S", 2.0)
EXECGO_NOTIFY_TIMEOUT_S = env_float("EXECGO_NOTIFY_TIMEOUT_S", 10.0)
# A decision link opened by someone not signed in may sign its approver in,
# in a session good for that one request only; off: they sign in first.
EXECGO_DECISION_LINK_SIGN_IN = env_bool("EXECGO_DECISION_LINK_SIGN_IN", False)
# A notification still pending this long after it was made is sent again (beat).
EXECGO_NOTIFY_RELAY_AFTER_S = env_int("EXECGO_NOTIFY_RELAY_AFTER_S", 300)  # (beat: EXECGO_NOTIFY_RELAY_INTERVAL_S, 60)

# A deliberately broken build, for the fault tests only (tests/reliability/): a
# worker claims and launches a step attempt without its fences, so a message
# delivered twice runs the step twice. The history checker must catch it; a system check
# refuses it anywhere else (runs/checks.py).
EXECGO_TEST_SKIP_FENCING = env_bool("EXECGO_TEST_SKIP_FENCING", False)

# --- Observability ----------------------------------------------------------

# prometheus_client's multiprocess mode: every process (web, each worker and
# pool child) counts into its own files here and /metrics sums them. The
# client reads PROMETHEUS_MULTIPROC_DIR when it is first imported, so it is
# set here, before any module imports it (and always from this setting: a
# process started with another data dir must not inherit its parent's).
EXECGO_METRICS_DIR = Path(env_str("EXECGO_METRICS_DIR", str(DATA_DIR / "metrics"))).resolve()
EXECGO_METRICS_DIR.mkdir(parents=True, exist_ok=True)
os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(EXECGO_METRICS_DIR)
# /readyz: how long the broker connection and the workers' ping may take.
EXECGO_READYZ_TIMEOUT_S = env_float("EXECGO_READYZ_TIMEOUT_S", 1.0)
# /metrics answers a scraper that sends this bearer token (and so does
# /readyz's detailed body); with none set it answers no one unless it is
# made public on purpose.
EXECGO_METRICS_TOKEN = env_str("EXECGO_METRICS_TOKEN", "")
EXECGO_METRICS_PUBLIC = env_bool("EXECGO_METRICS_PUBLIC", False)
# Beat writes an entry's last_run_at at every dispatch (its default waits
# three minutes), which /readyz reads to tell that beat runs the sweeper.
CELERY_BEAT_SYNC_EVERY = 1

# Logs: JSON lines (one object per line, with the request, run, step and
# handle ids bound while they are handled) unless EXECGO_LOG_FORMAT=text;
# text by default in DEBUG. EXECGO_LOG_FILE also appends them to a file.
EXECGO_LOG_FORMAT = env_str("EXECGO_LOG_FORMAT", "text" if DEBUG else "json")
EXECGO_LOG_FILE = env_str("EXECGO_LOG_FILE", "")
LOGGING = logging_config(log_format=EXECGO_LOG_FORMAT, log_file=EXECGO_LOG_FILE,
                         level=env_str("EXECGO_LOG_LEVEL", "INFO"), beat_schedule=CELERY_BEAT_SCHEDULE)
