#!/usr/bin/env bash
# kernel-vm.sh CMD [ARG...]: run CMD as root inside Debian's stock kernel, booted in QEMU.
#
# The kernel tier of the tests (`make test-kernel`) runs through this: on the machines plexd is built on, the
# host kernel has no WireGuard module, so the kernel backend, nftables on a distro kernel and the relay's kernel
# fast path are tested in a VM that boots the kernel a Debian server runs (linux-image-amd64, with wireguard.ko).
#
# How: virtme-ng boots the kernel with the host's root file system shared read-only over 9p (writes land in
# copy-on-write tmpfs overlays and vanish), so the repository's .venv runs inside unchanged. Nothing is
# installed on the host but QEMU and a few Debian packages: the kernel package is fetched with `apt-get
# download` and unpacked into the cache, virtme-ng lives in a venv of its own there.
#
# CMD runs in the current directory, through scripts/kernel-vm-guest.sh (modules, /dev/net/tun, PATH), with
# stdout/stderr streamed; the exit status is CMD's, 124 when the VM timed out, and 125 when the VM could not be
# prepared or booted (the reason is printed on a line starting "kernel-vm: cannot").
#
# Environment:
#   PLEXD_VM_CACHE   cache directory (default: .cache/vm in the repository; not under /var/cache, /var/tmp,
#                    /run or /tmp: the guest sees those as empty tmpfs)
#   PLEXD_VM_MEM     guest memory (default 2G)      PLEXD_VM_CPUS   guest vCPUs (default 2)
#   PLEXD_VM_TIMEOUT seconds before the VM is killed (default 1200)
#   PLEXD_VM_ACCEL   auto | kvm | tcg (default auto: KVM only where kvm_intel or kvm_amd is loaded; a
#                    pagetable-based /dev/kvm such as kvm_pvm boots no stock kernel, so auto takes TCG there)
#   PLEXD_VM_RWDIR   a host directory the guest writes through to (for results), optional
#   PLEXD_VM_KERNEL  the Debian kernel package (default: what linux-image-amd64 depends on now)
#   PLEXD_VM_VERBOSE=1  show the kernel's console
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${PLEXD_VM_CACHE:-$REPO/.cache/vm}
MEM=${PLEXD_VM_MEM:-2G}
CPUS=${PLEXD_VM_CPUS:-2}
TIMEOUT=${PLEXD_VM_TIMEOUT:-1200}
VNG_VERSION=1.42
VM_NAME=kernel-vm
. "$REPO/scripts/vm-common.sh"

[ $# -gt 0 ] || { echo "usage: $0 CMD [ARG...]" >&2; exit 2; }
[ "$(id -u)" -eq 0 ] || cannot "run: needs root (QEMU's 9p root share and the guest's root)"
case "$CACHE" in
    /var/cache/*|/var/tmp/*|/var/log/*|/run/*|/tmp/*) cannot "use PLEXD_VM_CACHE=$CACHE: the guest hides it" ;;
esac

# -- 1. host packages: QEMU, and what virtme-ng's init needs from the host (udev names the virtio ports) -------
vm_packages qemu-system-x86_64:qemu-system-x86 busybox:busybox-static /usr/bin/udevadm:udev modprobe:kmod
/usr/bin/python3 -c 'import ensurepip, venv' 2>/dev/null || vm_install python3-venv

# -- 2. the kernel: Debian's current stock package, unpacked (never installed on the host) ---------------------
vm_kernel "$CACHE"

# -- 3. virtme-ng, in a venv of its own on the system Python (the guest runs the same files) -------------------
VENV="$CACHE/vng-venv"
if ! "$VENV/bin/vng" --version 2>/dev/null | grep -q "$VNG_VERSION"; then
    say "installing virtme-ng $VNG_VERSION"
    rm -rf "$VENV"
    { /usr/bin/python3 -m venv "$VENV" && "$VENV/bin/pip" install -q "virtme-ng==$VNG_VERSION"; } >/dev/null 2>&1 \
        || cannot "install virtme-ng $VNG_VERSION from PyPI"
fi
export PATH="$VENV/bin:$PATH"  # vng runs virtme-run from PATH

# -- 4. the accelerator ------------------------------------------------------------------------------------------
accel=(--disable-kvm)
vm_kvm && accel=(--qemu-opts="-cpu host,-arch-capabilities")

# A second, read-only export of the host's root: the guest mounts it with cache=loose over the paths Python reads
# (virtme-ng's own root mount is uncached, and an uncached 9p lookup per import probe made `python -c pass` 6 s).
share=(--qemu-opts="-fsdev local,id=plexdhost,path=/,security_model=none,readonly=on,multidevs=remap"
       --qemu-opts="-device virtio-9p-pci,fsdev=plexdhost,mount_tag=plexd-host")
python_home=$(sed -n 's/^home = \(.*\)\/bin$/\1/p' "$REPO/.venv/pyvenv.cfg" 2>/dev/null || true)
opts=(--run "$KIMG" --memory "$MEM" --cpus "$CPUS" "${accel[@]}" "${share[@]}" --append "module_blacklist=$VM_BLACKLIST")
[ -n "${PLEXD_VM_RWDIR:-}" ] && opts+=(--rwdir="$PLEXD_VM_RWDIR")
[ "${PLEXD_VM_VERBOSE:-0}" = 1 ] && opts+=(--verbose)

cmd=$(printf '%q ' env "PLEXD_VM_CACHED=$REPO ${python_home:-} /usr/bin /usr/sbin /usr/lib/x86_64-linux-gnu" "$REPO/scripts/kernel-vm-guest.sh" "$@")
# QEMU opens its stdout as /proc/self/fd/1 with O_TRUNC, which would empty a log file the caller redirected us
# into: it gets pipes instead.
set +e
timeout --foreground -k 10 "$TIMEOUT" vng "${opts[@]}" --exec "$cmd" </dev/null > >(cat) 2> >(cat >&2)
rc=$?
wait
set -e
[ $rc -eq 124 ] && say "the VM timed out after ${TIMEOUT}s"
# virtme-ng exits 255 when its init never reached the command (no console, a kernel that did not boot)
[ $rc -eq 255 ] && cannot "boot $PKG (virtme-ng exited 255; PLEXD_VM_VERBOSE=1 shows the console)"
exit $rc
