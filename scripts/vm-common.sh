# Sourced by scripts/kernel-vm.sh and scripts/systemd-vm.sh: what both VMs need from the host. Nothing here is
# installed on the host but Debian packages: the kernel is fetched with `apt-get download` and unpacked.

say() { echo "${VM_NAME:-vm}: $*" >&2; }
cannot() { say "cannot $*"; exit 125; }

# vm_packages CMD:PACKAGE...: install the Debian packages whose command (a name, or a path) is missing.
vm_packages() {
    local need=() pair
    for pair in "$@"; do
        command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
    done
    vm_install "${need[@]}"
}

# vm_lock / vm_unlock: one host-wide lock around apt and the unpacking of the shared kernel. The kernel tier and the
# systemd tier start together: two apt runs at once fail on apt's own lock, and a second unpack would replace the
# kernel the first tier is booting.
vm_lock() {
    local dir=/run/lock
    [ -d "$dir" ] || dir=/tmp
    exec {VM_LOCK_FD}>"$dir/plexd-vm.lock"
    flock "$VM_LOCK_FD"
}
vm_unlock() { exec {VM_LOCK_FD}>&-; }

# vm_install PACKAGE...: install these Debian packages (quietly, in one apt run; none: nothing).
vm_install() {
    [ $# -eq 0 ] && return 0
    vm_lock
    say "installing $*"
    { apt-get -o DPkg::Lock::Timeout=300 update -qq && DEBIAN_FRONTEND=noninteractive apt-get \
        -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "$@"; } >/dev/null 2>&1 \
        || cannot "install the Debian packages $*"
    vm_unlock
}

# vm_kernel CACHE: Debian's current stock kernel package, unpacked under CACHE (kept). Sets PKG, KVER, KROOT, KIMG.
vm_kernel() {
    local cache=$1 tmp
    mkdir -p "$cache"
    PKG=${PLEXD_VM_KERNEL:-$(cat "$cache/kernel-pkg" 2>/dev/null || true)}
    if [ -z "$PKG" ]; then
        PKG=$(_kernel_pkg)
        [ -n "$PKG" ] || { apt-get update -qq >/dev/null 2>&1 || true; PKG=$(_kernel_pkg); }
        [ -n "$PKG" ] || cannot "find Debian's kernel package (apt-cache depends linux-image-amd64 names none)"
    fi
    KVER=${PKG#linux-image-}
    KROOT="$cache/$PKG"
    vm_lock  # the other tier may be fetching it now
    if [ ! -f "$KROOT/.done" ]; then
        say "fetching $PKG"
        tmp=$(mktemp -d)
        (cd "$tmp" && apt-get download "$PKG" >/dev/null 2>&1) || {
            apt-get update -qq >/dev/null 2>&1; (cd "$tmp" && apt-get download "$PKG" >/dev/null 2>&1); } \
            || { rm -rf "$tmp"; cannot "download $PKG (Debian drops old kernel ABIs: remove $cache/kernel-pkg)"; }
        rm -rf "$KROOT" && mkdir -p "$KROOT"
        dpkg-deb -x "$tmp/${PKG}"_*.deb "$KROOT" && depmod -b "$KROOT" "$KVER"
        rm -rf "$tmp"
        touch "$KROOT/.done"
    fi
    vm_unlock
    echo "$PKG" > "$cache/kernel-pkg"
    KIMG="$KROOT/boot/vmlinuz-$KVER"
    [ -f "$KIMG" ] || cannot "find the kernel image $KIMG"
}

_kernel_pkg() {
    apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}'
}

# vm_kvm: true where KVM can boot a stock kernel (kvm_intel or kvm_amd loaded, /dev/kvm writable). A
# pagetable-based /dev/kvm such as kvm_pvm boots none: QEMU emulates the CPU (TCG) there.
vm_kvm() {
    case "${PLEXD_VM_ACCEL:-auto}" in
        kvm) return 0 ;;
        tcg) return 1 ;;
        auto) { [ -r /sys/module/kvm_intel ] || [ -r /sys/module/kvm_amd ]; } && [ -w /dev/kvm ] ;;
        *) say "PLEXD_VM_ACCEL must be auto, kvm or tcg, not '${PLEXD_VM_ACCEL}'"; exit 2 ;;
    esac
}

# Drivers udev would load for QEMU's emulated hardware: none is needed, and each costs TCG time at boot.
VM_BLACKLIST=kvm_amd,kvm_intel,kvm,ccp,ahci,libahci,libata,ata_piix,ata_generic,sr_mod,cdrom,sg,psmouse,serio_raw,pcspkr,iTCO_wdt,i2c_i801,i2c_piix4,lpc_ich,evdev,intel_pmc_bxt,i6300esb,crct10dif_pclmul,crc32_pclmul,crc32c_intel,ghash_clmulni_intel,sha512_ssse3,sha256_ssse3,sha1_ssse3,aesni_intel,qemu_fw_cfg,floppy,parport_pc,button,joydev,bochs,drm,drm_kms_helper
