# The two commands a new user needs: `make demo` and `make test`. Both install what they need first.
PY := .venv/bin/python

.PHONY: setup demo test lint bench clean

setup:
	@scripts/setup.sh

demo: setup
	$(PY) -m plexd.devplane.cli demo $(DEMO_ARGS)

test: setup
	$(PY) -m ruff check plexd tests bench
	$(PY) -m pytest -q

lint: setup
	$(PY) -m ruff check plexd tests bench

bench: setup
	$(PY) -m bench

clean:
	rm -rf .venv build *.egg-info .pytest_cache
