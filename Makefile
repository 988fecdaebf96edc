# The two commands a newcomer needs:
#   make run    set everything up and serve the site on http://127.0.0.1:8000 (embedded model)
#   make test   set everything up and run the whole test suite (lint, types, tests)
# And while working: make check (lint, types, the unit and integration layers; README.md,
# "Contributing").
.PHONY: run test serve check lint bench scaleout

HOST ?= 127.0.0.1
PORT ?= 8000

# The settings default to production's (DEBUG off, a secret key required): what a newcomer runs
# asks for development mode, unless the environment says otherwise.
run test: export DJANGO_DEBUG ?= true

run:
	scripts/bootstrap
	$(MAKE) serve

# daphne, with a drain on SIGTERM or Ctrl-C (quotes/ops/server.py; a second Ctrl-C stops at once).
serve:
	.venv/bin/python -m quotes.ops.server -b $(HOST) -p $(PORT) --websocket-max-message-size 65536 --websocket-max-frame-size 65536 config.asgi:application

# Two daphne processes behind a real nginx, sharing PostgreSQL and Redis (docs/deployment.md).
scaleout:
	.venv/bin/python -m harness.scaleout

test:
	scripts/bootstrap --dev
	scripts/test

# The fast part: no real servers, no second database. QUOTES_TEST_WORKERS=0 runs it in one process;
# scripts/test says why --dist load.
check: lint
	cd packages/streaming && ../../.venv/bin/pytest -q -p no:django -p no:cacheprovider
	.venv/bin/pytest -m "unit or integration" -n $${QUOTES_TEST_WORKERS:-2} --dist load

lint:
	.venv/bin/ruff check --no-cache .
	.venv/bin/ruff format --no-cache --check .
	.venv/bin/mypy
