#!/usr/bin/env bash
# `make test`: the host suite (pytest on this machine) and the kernel tier (scripts/test-kernel.sh, a VM booting
# Debian's stock kernel) side by side: the host suite waits more than it computes, and the VM fills the gaps. The
# kernel tier's output is printed after the host suite's; the run fails if either fails.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p .cache
log=.cache/kernel-tier.log
started=$(date +%s)
set -m  # the kernel tier in a process group of its own, so that an interrupted run can end it (the VM included)
scripts/test-kernel.sh > "$log" 2>&1 &
kernel=$!
set +m
trap 'kill -- -$kernel 2>/dev/null; exit 130' INT TERM
.venv/bin/python -m pytest -q -n "${TEST_WORKERS:-4}" --dist loadgroup "$@"
host=$?
echo "host suite: exit status $host, $(( $(date +%s) - started ))s"
wait $kernel
kernel_rc=$?
echo "== the kernel tier (it ran alongside the host suite):"
cat "$log"
echo "make test: host suite $host, kernel tier $kernel_rc; $(( $(date +%s) - started ))s in all"
[ $host -eq 0 ] && [ $kernel_rc -eq 0 ]
