"""A LUKS2 volume made years ago with 512-byte sectors and an undated volume key, re-encrypted
online by `state.apply hana.storage` (reencrypt_online), on a real kernel, while mounted, with
the re-encryption killed and its power cut along the way.

The data volume (above LVM): a striped LV (2 x 64 KiB) of 1120 MiB, LUKS2 with 512-byte sectors
on it, an XFS with 4 KiB sectors inside, mounted, holding a checksummed file. The log volume
(below LVM): two disks, each LUKS2 with 4096-byte sectors and an undated key, a striped LV over
the two PVs, an XFS, mounted, a checksummed file. The pillar asks for 4096-byte sectors and a
cryptoperiod of 365 days, and caps each unit at 4 MiB/s so that each interruption lands in the
middle. The apply prepares each re-encryption (new volume keys; the data volume's sectors to
4096, each PV's kept), records today as each key's date and hands the rest to a unit per
device; nothing is unmounted, and the files read while they run. Then the data volume's
cryptsetup is killed (SIGKILL): the next apply changes nothing there and names the reboot (its
hotzone stack cannot be resumed online); the power is cut with all three running, and after the
boot the apply opens the volumes (libcryptsetup's recovery of each checksummed hotzone) and the
units go on, uncapped. At the end: the files' checksums, the sector sizes, the audit compliant
(the new keys dated today), a second apply changes nothing, and a boot without Salt opens and
mounts them. make test runs up to the online start and the files read meanwhile; the kill, the
power cut and the end are `long` (make test-all).
"""

import json
import shutil

import pytest
import yaml
from hana_storage_core import inplace, reencrypt

from tests.vm.conftest import (
    boot,
    boot_without_salt,
    close_storage,
    days_since_start,
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
LOG_DISKS = ["/dev/vdc", "/dev/vdd"]  # below LVM: a LUKS2 device on each, a PV on each mapping
LOG_CRYPTS = ["hana_log_0", "hana_log_1"]
LOG_MOUNT = "/hana/log"
LOG_FILE = f"{LOG_MOUNT}/a.bin"
UNITS = [UNIT] + [inplace.unit_name(c) for c in LOG_CRYPTS]


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
        },
        "log": {
            "mountpoint": LOG_MOUNT,
            "devices": LOG_DISKS,
            "encryption": "below_lvm",
            "stripes": 2,
            "stripe_size": 64,
            "size": "600M",
            "reencrypt_online": True,
        },
    }
    if max_mib_s:
        storage["in_place"] = {"max_mib_s": max_mib_s}
    return yaml.safe_dump({"hana": {"storage": storage}})


def build_old_data_volume(vm):
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


def build_old_log_volume(vm):
    vm.run(
        "set -e\n"
        + "".join(
            f"cryptsetup luksFormat -q --type luks2 --sector-size 4096 --pbkdf pbkdf2 "
            f"--pbkdf-force-iterations 1000 --label {crypt} --key-file {KEY_FILE} {disk}\n"
            f"cryptsetup open --key-file {KEY_FILE} {disk} {crypt}\n"
            for disk, crypt in zip(LOG_DISKS, LOG_CRYPTS, strict=True)
        )
        + f"pvcreate -q {' '.join('/dev/mapper/' + c for c in LOG_CRYPTS)}\n"
        f"vgcreate -q vg_hana_log {' '.join('/dev/mapper/' + c for c in LOG_CRYPTS)}\n"
        "lvcreate -q -y -i 2 -I 64k -L 600M -n lv_hana_log vg_hana_log\n"
        "mkfs.xfs -q -s size=4096 -d su=64k,sw=2 /dev/vg_hana_log/lv_hana_log\n"
        f"mkdir -p {LOG_MOUNT} && mount -o noatime,nodiratime /dev/vg_hana_log/lv_hana_log {LOG_MOUNT}\n"
        f"head -c 32M /dev/urandom >{LOG_FILE} && sync",
        check=True,
        title="below LVM: a LUKS2 PV with an undated key on each of two disks, a striped LV, mounted, "
        "32 MiB of data",
    )


def file_sums(vm):
    return vm.run(f"sha256sum {FILE} {LOG_FILE}", check=True, echo=False).output.split()[::2]


def header(vm):
    return json.loads(vm.run(f"cryptsetup luksDump --dump-json-metadata {LV}", check=True, echo=False).output)


@pytest.fixture(scope="module")
def vm(request):
    vm = boot(request, disks=len(DISKS + LOG_DISKS), disk_size="640M")
    vm.start_service_manager()
    write_lab_key(vm, KEY_FILE)
    build_old_data_volume(vm)
    build_old_log_volume(vm)
    vm.sums = file_sums(vm)
    vm.setup_salt(pillar(vm))
    return vm


def reencrypt_state(applied, volume="data", index=0):
    return [s for s in applied.ret.values() if s["__id__"] == f"hana-storage-{volume}-reencrypt-{index}"][0]


def log_headers(vm):
    return [
        json.loads(vm.run(f"cryptsetup luksDump --dump-json-metadata {d}", check=True, echo=False).output)
        for d in LOG_DISKS
    ]


def test_the_audit_finds_the_sector_size_and_the_undated_key(vm):
    audit = vm.salt("hana_storage.audit", check=True).ret
    found = sorted((f["rule"], f["volume"]) for f in audit["findings"])
    assert ("HANA-PERF-001", "data") in found and ("HANA-KEY-010", "data") in found, found
    assert ("HANA-KEY-010", "log") in found, found


def test_the_apply_re_encrypts_online_with_nothing_unmounted(vm):
    dry = vm.salt("state.apply hana.storage test=True", title="state.apply test=True: re-encrypt")
    state = reencrypt_state(dry)
    assert state["result"] is None and "its 512-byte sectors want 4096" in state["comment"], state
    applied = vm.salt("state.apply hana.storage", title="state.apply: re-encrypt online")
    assert applied.retcode == 0, applied.text()
    state = reencrypt_state(applied)
    assert state["changes"]["reencrypting"]["sector_size"] == 4096, state
    for index in range(len(LOG_DISKS)):  # each PV a new key at the sector size it has
        pv = reencrypt_state(applied, "log", index)
        assert pv["changes"]["reencrypting"]["sector_size"] == 4096, pv
    assert vm.run(f"findmnt -n -o SOURCE {MOUNT}", echo=False).output.strip() == CRYPT
    for meta in [header(vm), *log_headers(vm)]:
        dated = [t for t in meta["tokens"].values() if t["type"] == reencrypt.KEY_DATE_TOKEN]
        assert len(dated) == 1 and dated[0]["created"] in days_since_start(), dated
    for unit in UNITS:
        wait_for_progress(vm, unit, 1)
        assert vm.systemctl(f"is-active {unit}").output.strip() == "active"
    # cryptsetup holds I/O to the hotzone it works on: bounded, the files read while it runs
    # (cryptsetup's own hotzone was half the volume, held for minutes at this cap)
    read = vm.run(
        f"echo 3 >/proc/sys/vm/drop_caches; timeout 60 sha256sum {FILE} {LOG_FILE}",
        title="reading the files while the re-encryptions run",
    )
    assert read.output.split()[::2] == vm.sums, read.output
    # meanwhile the audit (and the beacon, which runs it) sees encrypted volumes whose stacks are
    # whole: a hotzone cryptsetup holds while it runs is no alarm (the old PBKDF2 keyslots are)
    audit = vm.salt("hana_storage.audit", check=True, title="hana_storage.audit while they run").ret
    alarms = [
        f for f in audit["findings"] if f["rule"] == "HANA-ENC-001" or f["rule"].startswith("HANA-LAYOUT-")
    ]
    assert not alarms, [f["message"] for f in alarms]


@pytest.mark.long  # make test-all
def test_a_killed_re_encryption_changes_nothing_and_names_the_reboot(vm):
    """cryptsetup killed in the middle leaves its hotzone stack (or a suspended device): no
    resume online is safe, and the apply says so with nothing written."""
    wait_for_progress(vm, UNIT, unit_progress(vm, UNIT)["percent"] + 2)
    vm.systemctl(f"kill --signal=KILL {UNIT}", title="SIGKILL to cryptsetup")
    wait_for_unit_end(vm, UNIT, timeout=120)
    before = header(vm)
    # a frozen stack holds any read of the volume: the apply must not read it
    again = vm.salt("state.apply hana.storage", title="state.apply after cryptsetup was killed", timeout=600)
    state = reencrypt_state(again)
    assert state["result"] is False and "Reboot the host" in state["comment"], state
    assert not state["changes"], state
    assert header(vm) == before
    assert vm.systemctl(f"is-active {UNIT}", check=False).output.strip() != "active"
    for index in range(len(LOG_DISKS)):  # the log's PVs go on meanwhile
        assert reencrypt_state(again, "log", index)["result"] is True, again.text()


@pytest.fixture(scope="module")
def after_power_cut(request, vm):
    """The power cut after the kill, the boot on the same disks (the guest's /etc and
    /var/lib/hana-storage are new: the header backup made before is put back), the apply with
    the cap lifted."""
    vm.run(f"cp {BACKUP} {vm.shared}/backup.luks-header", check=True, echo=False)
    kept = vm.workdir / "backup.luks-header"  # the shared directory is made anew at each boot
    vm.power_off()
    shutil.copy(vm.shared / "backup.luks-header", kept)
    again = boot(request, disks=len(DISKS + LOG_DISKS), disk_size="640M", fresh=False)
    again.start_service_manager()
    write_lab_key(again, KEY_FILE)
    again.run(
        f"mkdir -p -m 700 {BACKUPS} && cp {kept} {BACKUP} && chmod 400 {BACKUP}",
        check=True,
        title="the header backup made before the re-encryption, back in place",
    )
    again.sums = vm.sums
    again.setup_salt(pillar(again, max_mib_s=None))
    again.resumed = again.salt("state.apply hana.storage", title="state.apply after the power cut")
    return again


@pytest.mark.long  # make test-all
def test_after_the_power_cut_the_apply_opens_it_and_the_re_encryption_goes_on(after_power_cut):
    vm = after_power_cut
    assert vm.resumed.retcode == 0, vm.resumed.text()
    for volume, index in [("data", 0)] + [("log", i) for i in range(len(LOG_DISKS))]:
        state = reencrypt_state(vm.resumed, volume, index)
        assert state["changes"]["reencrypting"]["from"] in ("closed", "paused"), state
    assert vm.run(f"findmnt -n -o SOURCE {MOUNT}", echo=False).output.strip() == CRYPT
    for unit in UNITS:
        wait_for_unit_end(vm, unit, every=5)
    for device, unit in zip([LV, *LOG_DISKS], UNITS, strict=True):
        assert not reencryption_underway(vm, device), unit_progress(vm, unit)
    for meta in [header(vm), *log_headers(vm)]:
        assert meta["segments"]["0"]["sector_size"] == 4096
        assert "requirements" not in meta["config"] or not meta["config"]["requirements"].get("mandatory")
    assert vm.run("blockdev --getss " + CRYPT, echo=False).output.strip() == "4096"
    vm.run("echo 3 >/proc/sys/vm/drop_caches", check=True)
    assert file_sums(vm) == vm.sums


@pytest.mark.long  # make test-all
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
    audit = vm.salt("hana_storage.audit", check=True).ret
    assert audit["compliant"], audit["findings"]
    third = vm.salt("state.apply hana.storage", title="state.apply: nothing to do")
    assert not [s for s in third.ret.values() if s.get("changes")], third.text()


@pytest.mark.long  # make test-all
def test_a_boot_without_salt_opens_the_re_encrypted_volume(after_power_cut):
    vm = after_power_cut
    close_storage(vm, [MOUNT, LOG_MOUNT], ["vg_hana_data", "vg_hana_log"])
    out = boot_without_salt(vm)
    for crypt in ["hana_data", *LOG_CRYPTS]:
        assert f"attach {crypt} " in out, out
    assert f"mounted {MOUNT}" in out and f"mounted {LOG_MOUNT}" in out, out
    assert file_sums(vm) == vm.sums
