#!/usr/bin/env bash
# Install what the formula's tests, lab and demo need: Debian packages and a pinned venv.
# Idempotent and quiet when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(qemu-system-x86 linux-image-amd64 busybox-static cryptsetup-bin lvm2 xfsprogs dmsetup
              fio util-linux fdisk kmod e2fsprogs prometheus)
PYTHON=${PYTHON:-python3}

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "[deps] installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/tmp/hana-storage-apt.log 2>&1 \
        || { echo "[deps] apt-get failed; read /tmp/hana-storage-apt.log" >&2; exit 1; }
fi

stamp=".venv/.requirements-$(sha256sum requirements.txt | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    echo "[deps] creating .venv with the pinned Python packages (requirements.txt)"
    "$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), "Python 3.11 required"' \
        || { echo "[deps] need Python 3.11 as \$PYTHON (found $("$PYTHON" --version 2>&1))" >&2; exit 1; }
    "$PYTHON" -m venv .venv
    .venv/bin/pip install -q --upgrade pip
    .venv/bin/pip install -q -r requirements.txt \
        || { echo "[deps] pip install failed (see above)" >&2; exit 1; }
    rm -f .venv/.requirements-*
    touch "$stamp"
fi
