#!/usr/bin/env bash
# Runs inside the kernel VM (scripts/kernel-vm.sh) before the command: what a server's init would have done.
set -euo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PLEXD_KERNEL_VM=1  # the tests' tier marker: the kernel tier runs where this is set
# The modules a server loads on demand; loaded here so a failure says which one is missing.
for m in wireguard tun nf_tables; do
    modprobe "$m" || { echo "kernel-vm: cannot load the $m module" >&2; exit 125; }
done
# wireguard-go (the mixed mesh) needs the TUN device node, which virtme-ng's devtmpfs lacks.
mkdir -p /dev/net
[ -c /dev/net/tun ] || mknod /dev/net/tun c 10 200
ip link set lo up
# The paths named in PLEXD_VM_CACHED (the repository, Python's home, the binaries and shared libraries) come from
# the host's second export, mounted with cache=loose: read-only, and the host does not change them during the run.
# (Not the whole of /usr: virtme-ng links the guest kernel's modules into /usr/lib/modules, which autoloading
# needs.)
if [ -n "${PLEXD_VM_CACHED:-}" ] && mkdir -p /run/plexd-host \
        && mount -t 9p -o ro,trans=virtio,version=9p2000.L,cache=loose,msize=512000 plexd-host /run/plexd-host; then
    for d in $PLEXD_VM_CACHED; do
        [ -d "/run/plexd-host$d" ] && mount --bind "/run/plexd-host$d" "$d"
    done
fi
unset PLEXD_VM_CACHED
exec "$@"
