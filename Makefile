# The two commands a new user needs: `make demo` and `make test`. Both install what they need first.
PY := .venv/bin/python

.PHONY: setup demo test lint bench release clean

setup:
	@scripts/setup.sh

demo: setup
	$(PY) -m plexd.devplane.cli demo $(DEMO_ARGS)

# The suite waits far more than it computes (labs, handshakes, reconciles): four workers on two cores. Tests of a
# file stay together, and the files that use the root network namespace share one worker (tests/conftest.py).
TEST_WORKERS ?= 4

test: setup
	$(PY) -m ruff check plexd tests bench
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

lint: setup
	$(PY) -m ruff check plexd tests bench

bench: setup
	$(PY) -m bench

# A release zipapp for service.upgrade: make release VERSION=0.2.0 → build/plexd-0.2.0.pyz
release: setup
	@mkdir -p build
	$(PY) -m plexd.upgrade.zipapp build/plexd-$(or $(VERSION),dev).pyz $(if $(VERSION),--version $(VERSION))

clean:
	rm -rf .venv build *.egg-info .pytest_cache
