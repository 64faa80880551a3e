#!/usr/bin/env bash
# Install what the formula's tests, lab and demo need: Debian packages and one venv per supported
# Salt line, each from its lock (requirements/lock/salt-<line>.txt, made by tools/lock-requirements).
#   .venv       the newest line (3008): lint, the lab, the VM tier, the demo
#   .venv-3006  .venv-3007: the unit and integration tiers (and the VM events tier on 3006)
# Idempotent and quiet when everything is already there. `tools/install-deps.sh --lint` installs
# only what lint needs (no Debian packages: no QEMU, no kernel).
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(qemu-system-x86 linux-image-amd64 busybox-static cryptsetup-bin lvm2 xfsprogs dmsetup
              fio util-linux fdisk kmod e2fsprogs prometheus redis-server openssl tang clevis clevis-luks clevis-systemd clevis-tpm2 tpm2-tools swtpm swtpm-tools socat curl keyutils
              openscap-scanner chromium)
LINES=${SALT_LINES:-$(awk '!/^#/ && NF {print $1}' requirements/salt.in)}
NEWEST=$(awk '!/^#/ && NF {line=$1} END {print line}' requirements/salt.in)

if [ "${1:-}" != "--lint" ]; then
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
else
    LINES=$NEWEST
fi

python_for() {  # the interpreter a Salt line is tested on: pyenv's newest <version>, else python<version>
    local version=$1 root found
    root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
    found=$(ls -d "$root"/versions/"$version".*/bin/python"$version" 2>/dev/null | sort -V | tail -1)
    if [ -n "$found" ]; then echo "$found"
    elif command -v "python$version" >/dev/null && "python$version" -V >/dev/null 2>&1; then command -v "python$version"
    else
        echo "[deps] WARNING: no Python $version (pyenv or python$version on PATH): using $(python3 -V 2>&1)," \
             "so this line is not tested on the Python its onedir ships" >&2
        command -v python3
    fi
}

for line in $LINES; do
    read -r _ version python _ < <(awk -v l="$line" '$1 == l' requirements/salt.in)
    lock="requirements/lock/salt-$line.txt"
    venv=".venv-$line"
    [ "$line" = "$NEWEST" ] && venv=".venv"
    stamp="$venv/.lock-$(sha256sum "$lock" | cut -c1-16)"
    [ -f "$stamp" ] && continue
    interpreter=$(python_for "$python")
    echo "[deps] $venv: Salt $version on Python $python ($lock)"
    rm -rf "$venv"
    "$interpreter" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q --no-deps -r "$lock" \
        || { echo "[deps] pip install of $lock failed (see above)" >&2; exit 1; }
    touch "$stamp"
done
