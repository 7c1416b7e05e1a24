#!/usr/bin/env bash
# systemd-vm.sh SCRIPT [ARG...]: run SCRIPT as root in a Debian 12 system booted with systemd as PID 1.
#
# The systemd tier of the tests (scripts/test-systemd.sh) runs through this: plexd installed as an operator
# installs it (README, "Installing on Debian 12"), under the shipped unit, with systemd as PID 1, which no
# container these machines offer has.
#
# How: a bookworm root file system is built once with mmdebstrap from Debian's archive and kept as an ext4 image
# (cached; every boot uses it with QEMU's snapshot=on, so each run starts clean); Debian's stock kernel (shared
# with scripts/kernel-vm.sh) boots it through a small busybox initramfs. plexd's venv is made on the host with
# Debian's own Python 3.11 (the guest's) and shared read-only at the same path, as is this repository. SCRIPT
# runs from a unit started once the boot has finished, and the VM powers off when it is done.
#
# Exit status: SCRIPT's; 124 when the VM timed out; 125 when it could not be prepared or booted (a line starting
# "systemd-vm: cannot" says why).
#
# Environment:
#   PLEXD_SDVM_CACHE   image, venv, initramfs (default /var/lib/plexd-systemd-vm: outside any home directory,
#                      which the unit's ProtectHome hides from plexd)
#   PLEXD_VM_CACHE     the kernel's cache, shared with kernel-vm.sh (default .cache/vm in the repository)
#   PLEXD_VM_MEM (MiB, default 1536)  PLEXD_VM_CPUS (2)  PLEXD_VM_TIMEOUT (seconds, 1200)  PLEXD_VM_ACCEL (auto)
#   PLEXD_VM_VERBOSE=1 the guest's console on stderr
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
SCACHE=${PLEXD_SDVM_CACHE:-/var/lib/plexd-systemd-vm}
MEM=${PLEXD_VM_MEM:-1536}
CPUS=${PLEXD_VM_CPUS:-2}
TIMEOUT=${PLEXD_VM_TIMEOUT:-1200}
SUITE=bookworm
MIRROR=${PLEXD_VM_MIRROR:-http://deb.debian.org/debian}
SECURITY=${PLEXD_VM_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
# What the README's Debian section installs, what the tests drive plexd with (ssh, sshpass, ping), and systemd.
PACKAGES="systemd,systemd-sysv,udev,dbus,iproute2,nftables,libnftables1,wireguard-tools,wireguard-go,python3,\
python3-venv,iputils-ping,ca-certificates,openssh-client,sshpass,procps,kmod,util-linux,passwd"
IMAGE_REV=1  # bump when the guest's configuration below changes
VM_NAME=systemd-vm
. "$REPO/scripts/vm-common.sh"

[ $# -gt 0 ] || { echo "usage: $0 SCRIPT [ARG...]" >&2; exit 2; }
SCRIPT=$(readlink -f "$1"); shift
[ -f "$SCRIPT" ] || { echo "systemd-vm: no such script: $SCRIPT" >&2; exit 2; }
[ "$(id -u)" -eq 0 ] || cannot "run: needs root (mmdebstrap, and the guest's 9p shares)"

# -- 1. host packages ----------------------------------------------------------------------------------------------
vm_packages qemu-system-x86_64:qemu-system-x86 mmdebstrap:mmdebstrap mke2fs:e2fsprogs modprobe:kmod cpio:cpio
file -L /bin/busybox 2>/dev/null | grep -q static || vm_install busybox-static
/usr/bin/python3 -c 'import ensurepip, venv' 2>/dev/null || vm_install python3-venv
mkdir -p "$SCACHE"

# -- 2. the kernel, and an initramfs that mounts the ext4 root (virtio_blk and ext4 are modules) ---------------------
vm_kernel "${PLEXD_VM_CACHE:-$REPO/.cache/vm}"
INITRD="$SCACHE/initrd-$KVER.img"
if [ ! -f "$INITRD" ]; then
    d=$(mktemp -d)
    mkdir -p "$d"/{bin,dev,proc,sys,newroot,mods}
    cp /bin/busybox "$d/bin/busybox"
    n=0
    for m in virtio_pci virtio_blk ext4; do
        modprobe -d "$KROOT" -S "$KVER" --show-depends "$m" | awk '$1=="insmod"{print $2}'
    done | awk '!seen[$0]++' | while read -r ko; do
        n=$((n + 1)); cp "$ko" "$d/mods/$(printf %02d $n)-$(basename "$ko")"
    done
    cat > "$d/init" <<'EOF'
#!/bin/busybox sh
B=/bin/busybox
$B mount -t proc proc /proc; $B mount -t sysfs sysfs /sys; $B mount -t devtmpfs devtmpfs /dev
for m in /mods/*.ko; do $B insmod "$m" 2>/dev/null; done
i=0; while [ ! -b /dev/vda ] && [ $i -lt 200 ]; do $B usleep 50000; i=$((i + 1)); done
$B mount -t ext4 -o rw /dev/vda /newroot || { echo "initramfs: cannot mount /dev/vda" > /dev/console; $B poweroff -f; }
$B umount /proc /sys /dev
exec $B switch_root /newroot /sbin/init
EOF
    chmod +x "$d/init"
    (cd "$d" && find . | cpio -o -H newc 2>/dev/null) | gzip -1 > "$INITRD.tmp" && mv "$INITRD.tmp" "$INITRD"
    rm -rf "$d"
fi

# -- 3. the root file system, built once ---------------------------------------------------------------------------
KEY=$(printf '%s\n' "$SUITE" "$PACKAGES" "$KVER" "$IMAGE_REV" "$MIRROR" | sha256sum | cut -c1-12)
IMG="$SCACHE/$SUITE-$KEY.img"
if [ ! -f "$IMG" ]; then
    started=$(date +%s)
    B=$(mktemp -d "$SCACHE/build.XXXXXX")
    trap 'rm -rf "$B"' EXIT
    R="$B/root"
    say "building the $SUITE image (mmdebstrap, once)"
    mmdebstrap --variant=apt --mode=root --aptopt='Acquire::Check-Valid-Until "false"' --aptopt='Acquire::Retries "3"' \
        --include="$PACKAGES" --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' "$SUITE" "$R" "deb $MIRROR $SUITE main" \
        "deb $MIRROR $SUITE-updates main" "deb $SECURITY $SUITE-security main" > "$B/mmdebstrap.log" 2>&1 \
        || { tail -20 "$B/mmdebstrap.log" >&2; cannot "build the image (mmdebstrap failed; its log is above)"; }
    mkdir -p "$R/lib/modules"
    tar -C "$KROOT/lib/modules" --exclude="$KVER/kernel/sound" --exclude="$KVER/kernel/drivers/gpu" \
        --exclude="$KVER/kernel/drivers/media" --exclude="$KVER/kernel/drivers/infiniband" \
        --exclude="$KVER/kernel/drivers/net/wireless" --exclude="$KVER/kernel/drivers/net/ethernet" \
        --exclude="$KVER/kernel/drivers/usb" --exclude="$KVER/kernel/drivers/staging" \
        --exclude="$KVER/kernel/net/bluetooth" --exclude="$KVER/kernel/net/wireless" -cf - "$KVER" \
        | tar -C "$R/lib/modules" -xf -
    depmod -b "$R" "$KVER"
    echo sdvm > "$R/etc/hostname"
    printf '127.0.0.1 localhost\n127.0.1.1 sdvm\n' > "$R/etc/hosts"
    echo '/dev/vda / ext4 rw,errors=remount-ro 0 0' > "$R/etc/fstab"
    printf '9pnet_virtio\n9p\n' > "$R/etc/modules-load.d/9p.conf"
    chroot "$R" passwd -d root >/dev/null
    for unit in apt-daily.timer apt-daily-upgrade.timer dpkg-db-backup.timer fstrim.timer e2scrub_all.timer \
                e2scrub_reap.service; do
        chroot "$R" systemctl mask "$unit" >/dev/null 2>&1 || true
    done
    # The runner: mounts the control share, and runs what the host put there (so the image need not change).
    cat > "$R/usr/local/sbin/vmtest-runner" <<'EOF'
#!/bin/sh
mkdir -p /vmctl
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 vmctl /vmctl || exit 1
exec /bin/bash /vmctl/runner
EOF
    chmod 755 "$R/usr/local/sbin/vmtest-runner"
    cat > "$R/etc/systemd/system/vmtest.service" <<'EOF'
[Unit]
Description=The host's test script, then power off
After=multi-user.target
SuccessAction=poweroff-force
FailureAction=poweroff-force

[Service]
Type=exec
ExecStart=/usr/local/sbin/vmtest-runner
StandardOutput=journal+console
StandardError=journal+console
TimeoutStartSec=infinity

[Install]
WantedBy=multi-user.target
EOF
    chroot "$R" systemctl enable vmtest.service >/dev/null 2>&1
    tr -d - < /proc/sys/kernel/random/uuid > "$R/etc/machine-id"  # else every (snapshot) boot is a first boot
    size=$(( $(du -sm "$R" | cut -f1) + 1024 ))
    mke2fs -q -t ext4 -E root_owner=0:0 -d "$R" "$B/root.img" "${size}M" >/dev/null
    mv "$B/root.img" "$IMG"
    rm -rf "$B"; trap - EXIT
    find "$SCACHE" -maxdepth 1 -name "$SUITE-*.img" ! -name "$(basename "$IMG")" -delete
    say "image built in $(( $(date +%s) - started ))s"
fi

# -- 4. plexd's venv, made on the host with the guest's Python (Debian's 3.11): shared at the same path ---------------
VENV="$SCACHE/venv"
want=$(cat "$REPO/pyproject.toml" /usr/bin/python3 2>/dev/null | sha256sum | cut -c1-16)
if [ "$(cat "$VENV/.deps" 2>/dev/null)" != "$want" ]; then
    say "making plexd's venv for the guest"
    rm -rf "$VENV"
    { /usr/bin/python3 -m venv "$VENV" && "$VENV/bin/pip" install -q --upgrade pip \
        && "$VENV/bin/pip" install -q "$REPO[devplane]"; } > "$SCACHE/venv.log" 2>&1 \
        || { tail -5 "$SCACHE/venv.log" >&2; cannot "make plexd's venv (pip failed)"; }
    echo "$want" > "$VENV/.deps"
fi
# this checkout's code, not a stale copy (no dependency changes: quick)
"$VENV/bin/pip" install -q --no-deps --force-reinstall "$REPO" > "$SCACHE/venv.log" 2>&1 \
    || { tail -5 "$SCACHE/venv.log" >&2; cannot "install this checkout into the guest's venv"; }

# -- 5. the run ---------------------------------------------------------------------------------------------------
RUN=$(mktemp -d /tmp/plexd-sdvm.XXXXXX)
CTL="$RUN/vmctl"; mkdir -p "$CTL"
cleanup() { rm -rf "$RUN"; }
trap cleanup EXIT
cp "$SCRIPT" "$CTL/run.sh"; chmod 755 "$CTL/run.sh"
printf '%s\0' "$@" > "$CTL/args"
: > "$CTL/stdout"; : > "$CTL/stderr"
cat > "$CTL/runner" <<EOF
# In the guest: the shares at the host's own paths, the boot finished, then the script; output and status to /vmctl.
mkdir -p "$REPO" "$VENV"
mount -t 9p -o ro,trans=virtio,version=9p2000.L,msize=262144,cache=loose repo "$REPO"
mount -t 9p -o ro,trans=virtio,version=9p2000.L,msize=262144,cache=loose venv "$VENV"
systemctl is-system-running --wait > /vmctl/system_state 2>&1
args=(); [ -s /vmctl/args ] && mapfile -d '' -t args < /vmctl/args
cd "$REPO"
PLEXD_VENV="$VENV" PLEXD_REPO="$REPO" HOME=/root /vmctl/run.sh "\${args[@]}" </dev/null >/vmctl/stdout 2>/vmctl/stderr
echo \$? > /vmctl/rc.tmp && mv /vmctl/rc.tmp /vmctl/rc
EOF
accel=(-accel "tcg,thread=multi,tb-size=256" -cpu max)
vm_kvm && accel=(-accel kvm -cpu host)
CONSOLE="$RUN/console.log"
append="root=/dev/vda rw console=ttyS0 panic=-1 quiet loglevel=3 mitigations=off net.ifnames=0 \
module_blacklist=$VM_BLACKLIST systemd.show_status=false"
timeout -k 10 "$TIMEOUT" qemu-system-x86_64 -nodefaults -no-user-config -machine pc "${accel[@]}" \
    -m "$MEM" -smp "$CPUS" -display none -monitor none -no-reboot -serial "file:$CONSOLE" \
    -kernel "$KIMG" -initrd "$INITRD" -append "$append" \
    -drive "file=$IMG,if=virtio,format=raw,snapshot=on" \
    -virtfs "local,path=$CTL,mount_tag=vmctl,security_model=passthrough,id=vmctl" \
    -virtfs "local,path=$REPO,mount_tag=repo,security_model=passthrough,readonly=on,id=repo" \
    -virtfs "local,path=$VENV,mount_tag=venv,security_model=passthrough,readonly=on,id=venv" \
    -device virtio-rng-pci -nic none </dev/null &
qemu=$!
tail -q -n +1 -F --pid=$qemu "$CTL/stdout" 2>/dev/null &
tail -q -n +1 -F --pid=$qemu "$CTL/stderr" >&2 2>/dev/null &
[ "${PLEXD_VM_VERBOSE:-0}" = 1 ] && tail -q -n +1 -F --pid=$qemu "$CONSOLE" 2>/dev/null | sed 's/^/[console] /' >&2 &
set +e
wait $qemu; qrc=$?
sleep 0.3  # the tails' last lines
set -e
[ -f "$CTL/rc" ] && exit "$(cat "$CTL/rc")"
if [ $qrc -eq 124 ] || [ $qrc -eq 137 ]; then say "the VM timed out after ${TIMEOUT}s"; exit 124; fi
say "cannot boot the image: the VM ended (QEMU exit status $qrc) without a result; its console's end:"
tail -30 "$CONSOLE" >&2 || true
exit 125
