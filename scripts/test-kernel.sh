#!/usr/bin/env bash
# The kernel tier (`make test-kernel`, and part of `make test`): the tests marked `kernel` run inside one VM booting
# Debian's stock kernel (scripts/kernel-vm.sh), where the WireGuard module, nftables and the relay's fast path are
# the ones a Debian server runs. Arguments are passed to pytest (a file or -k to run a part of the tier).
#
# When the VM cannot be prepared or booted here, one line says why and the tier fails (exit 125): the tier is
# never skipped in silence, and in CI (which can boot it) a VM that does not boot is a failure like any other.
set -uo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
# TCG emulates the CPU: Python runs about 16x slower than on the host; the tests' waits stretch by this factor.
export PLEXD_TEST_LOAD_FACTOR=${PLEXD_TEST_LOAD_FACTOR:-4}
# Bytecode made here, where it is cheap: the guest reads the repo read-only and would compile every module of plexd
# in each Python process it starts (seconds each on its emulated CPU). Pytest's rewritten test modules too: its
# collection writes them (unless the environment says not to write bytecode, hence the env -u).
.venv/bin/python -m compileall -q -j 0 plexd tests bench > /dev/null
env -u PYTHONDONTWRITEBYTECODE PLEXD_KERNEL_VM=1 .venv/bin/python -m pytest -q -p no:cacheprovider --collect-only \
    "${@:-tests}" > /dev/null 2>&1
scripts/kernel-vm.sh env PLEXD_TEST_LOAD_FACTOR="$PLEXD_TEST_LOAD_FACTOR" PYTHONDONTWRITEBYTECODE=1 \
    .venv/bin/python -m pytest -q -p no:cacheprovider -p no:hypothesispytest -m kernel -n "${KERNEL_TEST_WORKERS:-0}" --dist loadfile \
    --durations=0 "${@:-tests}"
rc=$?
took=$(( $(date +%s) - started ))
case $rc in
    0) echo "kernel tier: passed in ${took}s (Debian's $(cat .cache/vm/kernel-pkg 2>/dev/null || echo kernel))" ;;
    125) echo "kernel tier: NOT RUN: the VM could not be prepared or booted here (the line above says why)" ;;
    124) echo "kernel tier: FAILED: the VM timed out after ${took}s" ;;
    *) echo "kernel tier: FAILED (exit status $rc) in ${took}s" ;;
esac
exit $rc
