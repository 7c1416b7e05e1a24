#!/usr/bin/env bash
# The systemd tier (`make test-systemd`, and part of `make test`): plexd installed under the shipped unit with
# systemd as PID 1, in a Debian 12 VM (scripts/systemd-vm.sh), checked by tests/systemd/installed_node.py.
#
# When the VM cannot be prepared or booted here, one line says why and the tier fails (exit 125): never a silent
# skip.
set -uo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
scripts/systemd-vm.sh tests/systemd/run-in-guest.sh
rc=$?
took=$(( $(date +%s) - started ))
case $rc in
    0) echo "systemd tier: passed in ${took}s" ;;
    125) echo "systemd tier: NOT RUN: the VM could not be prepared or booted here (the line above says why)" ;;
    124) echo "systemd tier: FAILED: the VM timed out after ${took}s" ;;
    *) echo "systemd tier: FAILED (exit status $rc) in ${took}s" ;;
esac
exit $rc
