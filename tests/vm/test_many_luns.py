"""Sixteen LUKS devices below LVM open at once at a boot without Salt in a 2 GiB guest (issue 33,
many LUNs): the seed's Power10 layout (eight LUNs under one volume) twice.

The pillar leaves the argon2 memory to cryptsetup, which would give each keyslot 1 GiB (its
default, and half of this guest's RAM): sixteen of them opening together would need 16 GiB. The
formula gives each keyslot an equal share of half the RAM among the devices opened at boot
(core.kdf). The boot opens every crypttab line at once, as systemd's units do; no open fails, the
kernel kills nothing, and the data is what was written. A keyslot added by hand above the share is
named by the audit (HANA-PERSIST-003), and is gone again before the boot.

The formula's keyslots made PBKDF2 again for FIPS mode (HANA-ENC-008) and booted are
tests/vm/test_lab_tpm.py's (the new keyslot proven before the old one goes, killed at every
write: tests/unit/test_attack16_fips_keyslots.py, on real headers): a PBKDF2 keyslot needs no
memory share, so sixteen of them prove no more than three. The whole module is `long` (make
test-all).
"""

import json
import re

import pytest
import yaml

from tests.vm.conftest import boot, boot_without_salt, close_storage, write_lab_key

pytestmark = [pytest.mark.vm, pytest.mark.long]  # make test-all

LUNS = 16
KEY_FILE = "/etc/hana-storage/keys/hana.key"
MOUNTPOINTS = ["/hana/data", "/hana/log"]
VGS = ["vg_hana_data", "vg_hana_log"]


def disk(index):
    return f"/dev/vd{'abcdefghijklmnop'[index]}"


@pytest.fixture(scope="module")
def vm(request):
    # 128 MiB each: 16 of LUKS2 header, the rest a PV; on eight, an XFS striped over eight gets
    # the 64 MiB log it needs
    vm = boot(request, disks=LUNS, disk_size="128M", memory="2G")
    write_lab_key(vm, KEY_FILE)
    storage = yaml.safe_load(vm.pillar())["hana"]["storage"]
    storage["key"] = {"source": "keyfile", "path": KEY_FILE}
    # cryptsetup chooses the memory; a fixed time cost keeps software emulation bearable
    storage["luks"]["pbkdf"] = {"type": "argon2id", "force_iterations": 4, "parallel": 1}
    storage["volumes"] = {
        name: {
            "mountpoint": mountpoint,
            "devices": [disk(8 * n + i) for i in range(8)],
            "encryption": "below_lvm",
            "stripe_size": 64,
        }
        for n, (name, mountpoint) in enumerate(zip(["data", "log"], MOUNTPOINTS, strict=True))
    }
    vm.setup_salt(yaml.safe_dump({"hana": {"storage": storage}}))
    return vm


@pytest.fixture(scope="module")
def ram_kib(vm):
    meminfo = vm.run("cat /proc/meminfo", check=True, echo=False).output
    return int(re.search(r"^MemTotal:\s+(\d+) kB", meminfo, re.M).group(1))


@pytest.fixture(scope="module")
def built(vm):
    applied = vm.salt("state.apply hana.storage", title=f"state.apply: two volumes on {LUNS} LUKS LUNs")
    assert applied.retcode == 0, [s["comment"] for s in applied.ret.values() if s["result"] is not True]
    return applied


def keyslot_memory(vm, device):
    dump = vm.run(f"cryptsetup luksDump --dump-json-metadata {device}", check=True, echo=False).output
    keyslots = json.loads(dump)["keyslots"]
    return {int(k): s["kdf"].get("memory") for k, s in keyslots.items()}


def audit(vm):
    return vm.salt("hana_storage.audit", check=True, title="hana_storage.audit").ret


def test_each_keyslot_gets_its_share_of_half_the_ram(vm, built, ram_kib):
    share = ram_kib // 2 // LUNS
    assert 48 << 10 < share < 64 << 10  # a 2 GiB guest: a little less than 64 MiB each
    assert {disk(i): keyslot_memory(vm, disk(i)) for i in range(LUNS)} == {
        disk(i): {0: share} for i in range(LUNS)
    }
    report = audit(vm)
    assert report["compliant"], [f["message"] for f in report["findings"]]


def test_a_keyslot_above_its_share_is_named_by_the_audit(vm, built, ram_kib):
    share = ram_kib // 2 // LUNS
    vm.run(
        f"cryptsetup luksAddKey -q --key-file {KEY_FILE} --new-keyfile {KEY_FILE} --new-key-slot 1 "
        f"--pbkdf argon2id --pbkdf-memory {4 * share} --pbkdf-force-iterations 4 --pbkdf-parallel 1 {disk(3)}",
        check=True,
        title="a keyslot with 4 times its share, added by hand",
    )
    try:
        findings = [f for f in audit(vm)["findings"] if f["rule"] == "HANA-PERSIST-003"]
        assert [(f["device"], f["actual"]) for f in findings] == [
            ("/dev/mapper/hana_data_3", [f"keyslot 1: {4 * share} KiB"])
        ], findings
        assert f"{LUNS} LUKS devices open together at boot" in findings[0]["message"]
    finally:
        vm.run(f"cryptsetup luksKillSlot -q {disk(3)} 1", check=True, title="the hand-made keyslot removed")


def test_all_sixteen_open_at_once_at_a_boot_without_salt(vm, built):
    files = " ".join(f"{m}/keep.bin" for m in MOUNTPOINTS)
    vm.run(
        f"for m in {' '.join(MOUNTPOINTS)}; do head -c 8M /dev/urandom >$m/keep.bin; done; sync", check=True
    )
    before = vm.run(f"sha256sum {files}", check=True, echo=False).output
    close_storage(vm, MOUNTPOINTS, VGS)
    vm.run("dmesg -C; rm -f /run/lowest-available", check=True, echo=False)
    sampler = vm.run(
        "(lowest=$(awk '/^MemAvailable/ {print $2}' /proc/meminfo); while [ ! -e /run/stop-sampling ]; do "
        "now=$(awk '/^MemAvailable/ {print $2}' /proc/meminfo); [ $now -lt $lowest ] && lowest=$now; "
        "echo $lowest >/run/lowest-available; sleep 0.2; done) >/dev/null 2>&1 & echo started",
        check=True,
        echo=False,
    )
    assert "started" in sampler.output
    try:
        out = boot_without_salt(vm, parallel=True, attach_timeout=600)
    finally:
        vm.run("touch /run/stop-sampling", echo=False)
    assert sorted(re.findall(r"^attach (\S+) ", out, re.M)) == sorted(
        f"hana_{v}_{i}" for v in ("data", "log") for i in range(8)
    ), out
    assert all(f"mounted {m}" in out for m in MOUNTPOINTS), out
    killed = vm.run("dmesg | grep -iE 'out of memory|oom-kill' || true", echo=False).output.strip()
    assert killed == "", killed
    lowest = int(vm.run("cat /run/lowest-available", check=True, echo=False).output.split()[0])
    print(f"16 LUKS devices opened at once; the guest's lowest MemAvailable meanwhile: {lowest // 1024} MiB")
    assert vm.run(f"sha256sum {files}", check=True, echo=False).output == before
    report = audit(vm)
    assert report["compliant"], [f["message"] for f in report["findings"]]
