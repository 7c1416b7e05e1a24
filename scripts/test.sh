#!/usr/bin/env bash
# `make test`: the host suite (pytest on this machine) and the two VM tiers side by side: the kernel tier
# (scripts/test-kernel.sh: Debian's stock kernel, its WireGuard and nftables) and the systemd tier
# (scripts/test-systemd.sh: plexd installed under its unit with systemd as PID 1). The host suite waits more than it
# computes, and the VMs fill the gaps. Each tier's output is printed after the host suite's; the run fails if any
# tier fails.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p .cache
started=$(date +%s)
set -m  # each VM tier in a process group of its own, so that an interrupted run can end it (its VM included)
scripts/test-kernel.sh > .cache/kernel-tier.log 2>&1 &
kernel=$!
# All three at the same priority: the systemd tier behind the kernel tier (nice 5) finished the kernel tier in 653 s
# instead of 903, but its starved VM then started plexd too slowly for the unit's watchdog.
scripts/test-systemd.sh > .cache/systemd-tier.log 2>&1 &
systemd=$!
set +m
trap 'kill -- -$kernel -$systemd 2>/dev/null; exit 130' INT TERM
# loadfile, not loadgroup: under pytest 9, pytest-xdist 3.8 drops the xdist_group markers (two tests of one file,
# which share the demo's /run/plexd-lab.json, ran at once on two workers); a file's tests stay on one worker.
.venv/bin/python -m pytest -q -n "${TEST_WORKERS:-4}" --dist loadfile "$@"
host=$?
echo "host suite: exit status $host, $(( $(date +%s) - started ))s"
wait $kernel
kernel_rc=$?
echo "== the kernel tier (it ran alongside the host suite):"
cat .cache/kernel-tier.log
wait $systemd
systemd_rc=$?
echo "== the systemd tier (it ran alongside the host suite):"
cat .cache/systemd-tier.log
echo "make test: host suite $host, kernel tier $kernel_rc, systemd tier $systemd_rc; $(( $(date +%s) - started ))s" \
     "in all"
[ $host -eq 0 ] && [ $kernel_rc -eq 0 ] && [ $systemd_rc -eq 0 ]
