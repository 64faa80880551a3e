"""A LUKS2 volume made years ago with 512-byte sectors and an undated volume key, re-encrypted
online by `state.apply hana.storage` (reencrypt_online), on a real kernel, while mounted, with
the re-encryption killed and its power cut along the way.

The data volume: a striped LV (2 x 64 KiB) of 1120 MiB, LUKS2 with 512-byte sectors on it, an XFS
with 4 KiB sectors inside, mounted, holding a checksummed file. The pillar asks for 4096-byte
sectors and a cryptoperiod of 365 days, and caps the unit at 4 MiB/s so that each interruption
lands in the middle. The apply prepares the re-encryption (a new volume key, 4096-byte sectors),
records today as the key's date and hands the rest to the unit; nothing is unmounted. Then
cryptsetup is killed (SIGKILL): the next apply changes nothing and names the reboot (its hotzone
stack cannot be resumed online); the power is cut, and after the boot the apply opens the
volume (libcryptsetup's recovery of the checksummed hotzone) and the unit goes on, uncapped. At
the end: the file's checksum, the sector size 4096, the audit compliant (the new key dated
today), a second apply changes nothing, and a boot without Salt opens and mounts it.
"""

import datetime
import json
import shutil

import pytest
import yaml
from hana_storage_core import inplace, reencrypt

from tests.vm.conftest import (
    boot,
    boot_without_salt,
    close_storage,
    reencryption_underway,
    unit_progress,
    wait_for_progress,
    wait_for_unit_end,
    write_lab_key,
)

pytestmark = pytest.mark.vm

KEY_FILE = "/etc/hana-storage/keys/hana.key"
DISKS = ["/dev/vda", "/dev/vdb"]
LV = "/dev/vg_hana_data/lv_hana_data"
CRYPT = "/dev/mapper/hana_data"
MOUNT = "/hana/data"
UNIT = inplace.unit_name("hana_data")
LV_MIB = 1120
FILE = f"{MOUNT}/a.bin"
BACKUPS = "/var/lib/hana-storage/luks-headers"
BACKUP = f"{BACKUPS}/hana_data.luks-header"


def pillar(vm, max_mib_s=4):
    storage = yaml.safe_load(vm.pillar())["hana"]["storage"]
    storage["key"] = {"source": "keyfile", "path": KEY_FILE}
    storage["luks"]["volume_key_max_age_days"] = 365
    storage["header_backup"] = {"directory": BACKUPS}
    storage["volumes"] = {
        "data": {
            "mountpoint": MOUNT,
            "devices": DISKS,
            "stripes": 2,
            "stripe_size": 64,
            "size": f"{LV_MIB}M",
            "reencrypt_online": True,
        }
    }
    if max_mib_s:
        storage["in_place"] = {"max_mib_s": max_mib_s}
    return yaml.safe_dump({"hana": {"storage": storage}})


def build_old_volume(vm):
    vm.run(
        "set -e\n"
        f"pvcreate -q {' '.join(DISKS)}\n"
        f"vgcreate -q vg_hana_data {' '.join(DISKS)}\n"
        f"lvcreate -q -y -i 2 -I 64k -L {LV_MIB}M -n lv_hana_data vg_hana_data\n"
        f"cryptsetup luksFormat -q --type luks2 --sector-size 512 --pbkdf pbkdf2 "
        f"--pbkdf-force-iterations 1000 --label hana_data --key-file {KEY_FILE} {LV}\n"
        f"cryptsetup open --key-file {KEY_FILE} {LV} hana_data\n"
        f"mkfs.xfs -q -s size=4096 -d su=64k,sw=2 {CRYPT}\n"
        f"mkdir -p {MOUNT} && mount -o noatime,nodiratime,logbsize=256k {CRYPT} {MOUNT}\n"
        f"head -c 96M /dev/urandom >{FILE} && sync\n"
        f"mkdir -p -m 700 {BACKUPS} && cryptsetup luksHeaderBackup {LV} --header-backup-file {BACKUP}\n"
        f"chmod 400 {BACKUP}",
        check=True,
        title="a LUKS2 volume with 512-byte sectors and an undated key, mounted, 96 MiB of data, "
        "its header backed up",
    )


def file_sum(vm):
    return vm.run(f"sha256sum {FILE}", check=True, echo=False).output.split()[0]


def header(vm):
    return json.loads(vm.run(f"cryptsetup luksDump --dump-json-metadata {LV}", check=True, echo=False).output)


@pytest.fixture(scope="module")
def vm(request):
    vm = boot(request, disks=len(DISKS), disk_size="1G")
    vm.start_service_manager()
    write_lab_key(vm, KEY_FILE)
    build_old_volume(vm)
    vm.sum = file_sum(vm)
    vm.setup_salt(pillar(vm))
    return vm


def reencrypt_state(applied):
    return [s for s in applied.ret.values() if s["__id__"] == "hana-storage-data-reencrypt-0"][0]


def test_the_audit_finds_the_sector_size_and_the_undated_key(vm):
    audit = vm.salt("hana_storage.audit volumes=data", check=True).ret
    found = sorted(f["rule"] for f in audit["findings"])
    assert "HANA-PERF-001" in found and "HANA-KEY-010" in found, audit["findings"]


def test_the_apply_re_encrypts_online_with_nothing_unmounted(vm):
    dry = vm.salt("state.apply hana.storage test=True", title="state.apply test=True: re-encrypt")
    state = reencrypt_state(dry)
    assert state["result"] is None and "its 512-byte sectors want 4096" in state["comment"], state
    applied = vm.salt("state.apply hana.storage", title="state.apply: re-encrypt online")
    state = reencrypt_state(applied)
    assert state["result"] is True and state["changes"]["reencrypting"]["sector_size"] == 4096, state
    assert vm.run(f"findmnt -n -o SOURCE {MOUNT}", echo=False).output.strip() == CRYPT
    dated = [t for t in header(vm)["tokens"].values() if t["type"] == reencrypt.KEY_DATE_TOKEN]
    assert [t["created"] for t in dated] == [datetime.date.today().isoformat()], dated
    wait_for_progress(vm, UNIT, 1)
    assert vm.systemctl(f"is-active {UNIT}").output.strip() == "active"
    vm.run("echo 3 >/proc/sys/vm/drop_caches", check=True)
    assert file_sum(vm) == vm.sum  # read while it runs


def test_a_killed_re_encryption_changes_nothing_and_names_the_reboot(vm):
    """cryptsetup killed in the middle leaves its hotzone stack (or a suspended device): no
    resume online is safe, and the apply says so with nothing written."""
    wait_for_progress(vm, UNIT, unit_progress(vm, UNIT)["percent"] + 2)
    vm.systemctl(f"kill --signal=KILL {UNIT}", title="SIGKILL to cryptsetup")
    wait_for_unit_end(vm, UNIT, timeout=60)
    before = header(vm)
    again = vm.salt("state.apply hana.storage", title="state.apply after cryptsetup was killed")
    state = reencrypt_state(again)
    assert state["result"] is False and "Reboot the host" in state["comment"], state
    assert not state["changes"], state
    assert header(vm) == before
    assert vm.systemctl(f"is-active {UNIT}").output.strip() != "active"


@pytest.fixture(scope="module")
def after_power_cut(request, vm):
    """The power cut after the kill, the boot on the same disks (the guest's /etc and
    /var/lib/hana-storage are new: the header backup made before is put back), the apply with
    the cap lifted."""
    vm.run(f"cp {BACKUP} {vm.shared}/backup.luks-header", check=True, echo=False)
    kept = vm.workdir / "backup.luks-header"  # the shared directory is made anew at each boot
    vm.power_off()
    shutil.copy(vm.shared / "backup.luks-header", kept)
    again = boot(request, disks=len(DISKS), disk_size="1G", fresh=False)
    again.start_service_manager()
    write_lab_key(again, KEY_FILE)
    again.run(
        f"mkdir -p -m 700 {BACKUPS} && cp {kept} {BACKUP} && chmod 400 {BACKUP}",
        check=True,
        title="the header backup made before the re-encryption, back in place",
    )
    again.sum = vm.sum
    again.setup_salt(pillar(again, max_mib_s=None))
    again.resumed = again.salt("state.apply hana.storage", title="state.apply after the power cut")
    return again


def test_after_the_power_cut_the_apply_opens_it_and_the_re_encryption_goes_on(after_power_cut):
    vm = after_power_cut
    assert vm.resumed.retcode == 0, vm.resumed.text()
    state = reencrypt_state(vm.resumed)
    assert state["changes"]["reencrypting"]["from"] in ("closed", "paused"), state
    assert vm.run(f"findmnt -n -o SOURCE {MOUNT}", echo=False).output.strip() == CRYPT
    wait_for_unit_end(vm, UNIT)
    assert not reencryption_underway(vm, LV), unit_progress(vm, UNIT)
    meta = header(vm)
    assert meta["segments"]["0"]["sector_size"] == 4096
    assert "requirements" not in meta["config"] or not meta["config"]["requirements"].get("mandatory")
    assert vm.run("blockdev --getss " + CRYPT, echo=False).output.strip() == "4096"
    vm.run("echo 3 >/proc/sys/vm/drop_caches", check=True)
    assert file_sum(vm) == vm.sum


def test_then_the_audit_is_compliant_and_a_second_apply_changes_nothing(after_power_cut):
    """The header backup made before holds the old volume key only: the apply makes it anew
    (never the "restore from it" of HANA-KEY-007: that would make the data unreadable)."""
    vm = after_power_cut
    audit = vm.salt("hana_storage.audit volumes=data", check=True).ret
    backup = [
        f for f in audit["findings"] if f["rule"].startswith("HANA-KEY-00") and "backup" in f["message"]
    ]
    assert [f["rule"] for f in backup] == ["HANA-KEY-006"], backup
    again = vm.salt("state.apply hana.storage", title="state.apply after the re-encryption")
    assert again.retcode == 0
    assert [s for s in again.ret.values() if s["changes"].get("header_backup") == BACKUP], again.text()
    audit = vm.salt("hana_storage.audit volumes=data", check=True).ret
    assert audit["compliant"], audit["findings"]
    third = vm.salt("state.apply hana.storage", title="state.apply: nothing to do")
    assert not [s for s in third.ret.values() if s.get("changes")], third.text()


def test_a_boot_without_salt_opens_the_re_encrypted_volume(after_power_cut):
    vm = after_power_cut
    close_storage(vm, [MOUNT], ["vg_hana_data"])
    out = boot_without_salt(vm)
    assert "attach hana_data " in out and f"mounted {MOUNT}" in out, out
    assert file_sum(vm) == vm.sum
