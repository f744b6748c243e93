# ExecGo — the two entry points a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PG_URL ?= postgres://postgres@127.0.0.1:5432/test
REDIS_BROKER ?= redis://127.0.0.1:6379/14
REDIS_LAYER ?= redis://127.0.0.1:6379/15

.PHONY: run test test-deps test-sqlite test-postgres lint bench migrate clean sandbox

## Python's bytecode cache stays on (an environment may turn it off): without it every
## process the suite starts compiles each module it imports again, and each test process
## rewrites every test module's asserts again (collection took twice as long).
unexport PYTHONDONTWRITEBYTECODE

## The packages are installed with uv (pip only installs uv): on a machine whose package
## caches are empty, 11 s where pip took 30 s, the same versions. They are compiled on
## every core at once after the install (neither compiles by default); left to their
## first import instead, each test process would compile the same modules at the same
## time. As pip's own compiling, it passes over a file that does not compile (some
## packages ship such files as data).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet uv
	$(BIN)/uv pip install --quiet --python $(BIN)/python -e ".[dev]"
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib execgo runs policy approvals pages runtime client > /dev/null || true
	touch $(STAMP)

migrate: $(STAMP)
	$(BIN)/python manage.py migrate --noinput

## bubblewrap contains shell steps best, with libseccomp2 for its system call filter; installed here
## where that is possible (apt as root).
HAS_LIBSECCOMP := /sbin/ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2'
sandbox:
	@command -v bwrap >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; } >/dev/null 2>&1; } || \
	  echo "bubblewrap is not installed: shell steps run in the weaker process profile (install the bubblewrap package to fix)"
	@$(HAS_LIBSECCOMP) || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libseccomp2; } >/dev/null 2>&1; } || \
	  echo "libseccomp2 is not installed: sandboxed steps run without their system call filter (install libseccomp2 to fix)"

## Set up and start web + worker + beat on the embedded default (SQLite + filesystem broker),
## in debug mode unless DJANGO_DEBUG says otherwise (debug off needs a secret key and host names).
run migrate: export DJANGO_DEBUG ?= true
run: sandbox migrate
	$(BIN)/python manage.py execgo_run

## Set up and run the whole suite on SQLite, then on PostgreSQL + Redis; each
## phase's wall time is printed at the end. (The two passes side by side are
## no faster on two cores: the suite is bound by CPU there.)
TEST_PHASES := lint test-sqlite test-postgres
test: test-deps
	@times=""; for phase in $(TEST_PHASES); do started=$$(date +%s); \
	  $(MAKE) --no-print-directory $$phase; status=$$?; \
	  times="$$times $$phase $$(( $$(date +%s) - started )) s;"; \
	  if [ $$status -ne 0 ]; then echo "make test wall time:$$times (failed)"; exit $$status; fi; done; \
	  echo "make test wall time:$$times"

## The programs the tests run, and the Debian package of each: installed with apt
## where this runs as root, otherwise named, and the run stops at once.
TEST_PROGRAMS := bwrap:bubblewrap unshare:util-linux pasta:passt chromium:chromium promtool:prometheus
test-deps:
	@missing=""; for pair in $(TEST_PROGRAMS); do \
	  command -v $${pair%%:*} >/dev/null 2>&1 || missing="$$missing $${pair#*:}"; done; \
	$(HAS_LIBSECCOMP) || missing="$$missing libseccomp2"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing$$missing (apt-get)"; \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; } >/dev/null || exit 1; \
	  else echo "make test needs the package(s)$$missing: install them (apt-get install$$missing) and run it again"; \
	    exit 1; fi; fi

## pytest-xdist: each worker process has a database, data directory, Redis
## databases and sandbox uids of its own (tests/settings.py).
PYTEST_WORKERS ?= 4
PYTEST := $(BIN)/pytest -q -n $(PYTEST_WORKERS) --durations=30

test-sqlite: $(STAMP)
	EXECGO_DATA_DIR=$(CURDIR)/var/test-sqlite $(PYTEST)

test-postgres: $(STAMP)
	EXECGO_DATA_DIR=$(CURDIR)/var/test-postgres DATABASE_URL=$(PG_URL) CELERY_BROKER_URL=$(REDIS_BROKER) \
	REDIS_URL=$(REDIS_LAYER) $(PYTEST)

## Layer contract (runtime never imports runs/approvals), pending migrations, pyflakes errors, import order.
lint: export DJANGO_DEBUG ?= true
lint: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/python manage.py makemigrations --check --dry-run
	$(BIN)/ruff check execgo runs policy approvals pages runtime tests bench client

bench: $(STAMP)
	$(BIN)/python bench/bench_run_latency.py

clean:
	rm -rf var
