# ExecGo — the two entry points a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PG_URL ?= postgres://postgres@127.0.0.1:5432/test
REDIS_BROKER ?= redis://127.0.0.1:6379/14
REDIS_LAYER ?= redis://127.0.0.1:6379/15

.PHONY: run test test-sqlite test-postgres lint bench migrate clean sandbox

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

migrate: $(STAMP)
	$(BIN)/python manage.py migrate --noinput

## bubblewrap contains shell steps best; installed here where that is possible (apt as root).
sandbox:
	@command -v bwrap >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; } >/dev/null 2>&1; } || \
	  echo "bubblewrap is not installed: shell steps run in the weaker process profile (install the bubblewrap package to fix)"

## Set up and start web + worker + beat on the embedded default (SQLite + filesystem broker),
## in debug mode unless DJANGO_DEBUG says otherwise (debug off needs a secret key and host names).
run migrate: export DJANGO_DEBUG ?= true
run: sandbox migrate
	$(BIN)/python manage.py execgo_run

## Set up and run the whole suite on SQLite, then on PostgreSQL + Redis.
test: lint test-sqlite test-postgres

test-sqlite: $(STAMP)
	EXECGO_DATA_DIR=$(CURDIR)/var/test-sqlite $(BIN)/pytest -q

test-postgres: $(STAMP)
	EXECGO_DATA_DIR=$(CURDIR)/var/test-postgres DATABASE_URL=$(PG_URL) CELERY_BROKER_URL=$(REDIS_BROKER) \
	REDIS_URL=$(REDIS_LAYER) $(BIN)/pytest -q

## Layer contract (runtime never imports runs/approvals), pending migrations, pyflakes errors, import order.
lint: export DJANGO_DEBUG ?= true
lint: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/python manage.py makemigrations --check --dry-run
	$(BIN)/ruff check execgo runs approvals runtime tests bench client

bench: $(STAMP)
	$(BIN)/python bench/bench_run_latency.py

clean:
	rm -rf var
