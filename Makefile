# The two commands a newcomer needs:
#   make run    set everything up and serve the site on http://127.0.0.1:8000 (embedded model)
#   make test   set everything up and run the whole test suite (lint, types, tests)
.PHONY: run test serve check lint bench scaleout

HOST ?= 127.0.0.1
PORT ?= 8000

run:
	scripts/bootstrap
	$(MAKE) serve

# daphne, with a drain on SIGTERM or Ctrl-C (quotes/server.py; a second Ctrl-C stops at once).
serve:
	.venv/bin/python -m quotes.server -b $(HOST) -p $(PORT) config.asgi:application

# Two daphne processes behind a real nginx, sharing PostgreSQL and Redis (docs/deployment.md).
scaleout:
	.venv/bin/python -m tests.scaleout.run

test:
	scripts/bootstrap --dev
	scripts/test

lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy
