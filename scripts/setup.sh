#!/usr/bin/env bash
# Installs everything plexd's demo and tests need on a fresh Debian 12 machine: the system packages
# (wireguard-go, wg, nftables, coturn, iproute2, ping) and a .venv with plexd in editable mode.
# Idempotent and quick when nothing changed (a stamp file records what was installed).
set -euo pipefail
cd "$(dirname "$0")/.."

# systemd provides systemd-analyze (the unit test checks plexd.service offline); netbase gives /etc/services.
# iperf3: the relay and TCP-session benches; openssh-client and sshpass: the real ssh client the SSH
# access-session tests and bench log in with. ca-certificates: the trust store the control-plane client verifies
# with; openssl: the trust-store tests hash a CA into a directory as update-ca-certificates does. libfaketime:
# the chaos bench and its smoke test step plexd's own wall clock (never the machine's).
APT_PACKAGES="wireguard-go wireguard-tools nftables libnftables1 iproute2 iputils-ping coturn systemd netbase iperf3
              openssh-client sshpass ca-certificates openssl libfaketime"

missing=""
for p in $APT_PACKAGES; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "setup: need root to install Debian packages:$missing" >&2
        exit 1
    fi
    echo "setup: installing Debian packages:$missing"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

stamp=.venv/.plexd-setup-stamp
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "setup: creating .venv"
    python3 -m venv .venv
    .venv/bin/pip install -q --upgrade pip >/dev/null
    .venv/bin/pip install -q -e '.[test,devplane]'
    echo "$want" > "$stamp"
fi
