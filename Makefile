# The two commands a new user needs: `make demo` and `make test`. Both install what they need first.
PY := .venv/bin/python

.PHONY: setup demo test test-kernel test-systemd lint bench release release-key clean

setup:
	@scripts/setup.sh

demo: setup
	$(PY) -m plexd.devplane.devplane_cli demo $(DEMO_ARGS)

# The suite waits far more than it computes (labs, handshakes, reconciles): four workers on two cores. Tests of a
# file stay together, and the files that use the root network namespace share one worker (tests/conftest.py).
# The kernel tier (a VM booting Debian's stock kernel) and the systemd tier (a VM with systemd as PID 1) run
# alongside (scripts/test.sh).
TEST_WORKERS ?= 4

test: setup
	$(PY) -m ruff check plexd tests bench
	TEST_WORKERS=$(TEST_WORKERS) scripts/test.sh

# The kernel tier alone: the tests marked `kernel`, in a VM booting Debian's stock kernel (README, Tests).
test-kernel: setup
	scripts/test-kernel.sh

# The systemd tier alone: plexd installed under its unit, systemd as PID 1, in a Debian 12 VM (README, Tests).
test-systemd: setup
	scripts/test-systemd.sh

lint: setup
	$(PY) -m ruff check plexd tests bench

bench: setup
	$(PY) -m bench

# A signed release zipapp for service.upgrade:
#   make release VERSION=0.2.0 RELEASE_KEY=~/plexd-release.key → build/plexd-0.2.0.pyz and build/plexd-0.2.0.pyz.sig
# A key: python -m plexd.upgrade.signing keygen FILE (prints the public key for the nodes' upgrade.release_keys).
release: release-key setup
	@mkdir -p build
	$(PY) -m plexd.upgrade.zipapp build/plexd-$(or $(VERSION),dev).pyz $(if $(VERSION),--version $(VERSION))
	$(PY) -m plexd.upgrade.signing sign "$(RELEASE_KEY)" build/plexd-$(or $(VERSION),dev).pyz \
		"$(or $(VERSION),$$($(PY) -c 'import plexd; print(plexd.__version__)'))"

release-key:
	@test -n "$(RELEASE_KEY)" -a -r "$(RELEASE_KEY)" || { echo "make release: RELEASE_KEY=FILE must name a readable release key (python -m plexd.upgrade.signing keygen FILE makes one); got '$(RELEASE_KEY)'" >&2; exit 1; }

clean:
	rm -rf .venv build *.egg-info .pytest_cache .cache/vm
