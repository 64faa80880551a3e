"""The Power10 seed's layouts on multipath SAN LUNs, on a real kernel, and a boot without Salt.

Eight LUNs, each a disk image attached twice (two paths, the same serial), with a dm-multipath
map per LUN named as multipathd names them (/dev/mapper/mpatha .. mpathh, dm UUID mpath-<wwid>);
then LVM sees only the maps (lvm.conf global_filter, as a real multipath host must). A ninth LUN has
no map: its paths stand for a host where multipath is not set up.

- first without an LVM filter, as a host whose LVM also scans the paths (issue 29): the guard
  refuses before anything is written, naming the paths and the fix, every LUN byte-identical;
- above LVM: one LUKS2 on an LV striped -i 8 -I 128k over the eight maps;
- below LVM: LUKS2 on each map, the opened devices as PVs, the LV striped over them;
each built by state.apply, audited compliant, then closed and brought back the way the host
boots - systemd-cryptsetup for each /etc/crypttab line, LVM activation, the mounts of
/etc/fstab - with no Salt, and audited compliant again.
"""

import json

import pytest
import yaml
from hana_storage_core import report as hana_storage_report

from tests.vm.conftest import beacon_tick, boot, boot_without_salt, close_storage

pytestmark = pytest.mark.vm

LUNS = 8
DISKS = LUNS + 1  # the ninth LUN has no multipath map
MAPS = [f"mpath{chr(ord('a') + i)}" for i in range(LUNS)]
KEY_FILE = "/etc/hana-storage/keys/hana.key"
LVM_CONF = 'devices {\n  global_filter = [ "a|^/dev/mapper/|", "r|.*|" ]\n}\n'


def path(lun, n):
    """Guest device of path n (0, 1) of a LUN: first paths vda.., then the second ones."""
    return "/dev/vd" + "abcdefghijklmnopqrstuvwxyz"[lun + n * DISKS]


def create_maps():
    """The maps as multipathd makes them, and the link udev's 13-dm-disk.rules gives each (the
    guest runs no udev): /dev/disk/by-id/dm-uuid-mpath-<wwid>, what crypttab names a map by."""
    return "modprobe -a dm-multipath dm-round-robin\nmkdir -p /dev/disk/by-id\n" + "".join(
        f'dmsetup create {name} -u mpath-lun{i} --table "0 $(blockdev --getsz {path(i, 0)}) multipath '
        f'0 0 1 1 round-robin 0 2 1 {path(i, 0)} 1 {path(i, 1)} 1"\n'
        f"ln -sfn /dev/mapper/{name} /dev/disk/by-id/dm-uuid-mpath-lun{i}\n"
        for i, name in enumerate(MAPS)
    )


def pillar(vm, volumes):
    storage = yaml.safe_load(vm.pillar())["hana"]["storage"]
    storage["key"] = {"source": "keyfile", "path": KEY_FILE}  # unlocks at boot, no Salt needed
    storage["volumes"] = volumes
    return yaml.safe_dump({"hana": {"storage": storage}})


SEED_ABOVE = {
    "data": {"mountpoint": "/hana/data", "devices": [f"/dev/mapper/{m}" for m in MAPS], "stripe_size": 128}
}
SEED_BELOW = {
    "log": {
        "mountpoint": "/hana/log",
        "devices": [f"/dev/mapper/{m}" for m in MAPS],
        "encryption": "below_lvm",
        "stripe_size": 128,
        "allow_format": [f"/dev/mapper/{m}" for m in MAPS],  # they hold the above-LVM layout's PVs
    }
}


def close_all(vm, mountpoint, vg):
    """A shutdown: the stack closed and the multipath maps gone; they come back at boot (multipathd)."""
    close_storage(vm, [mountpoint], [vg], then="".join(f"dmsetup remove {m}\n" for m in MAPS) + create_maps())


@pytest.fixture(scope="module")
def vm(request):
    vm = boot(request, disks=DISKS, disk_size="1G", paths=2)
    vm.run(
        create_maps() + "mkdir -p /etc/lvm /etc/hana-storage/keys\n",
        check=True,
        title="multipath maps over 8 LUNs",
    )
    vm.run(f"echo {vm.key_b64()} | base64 -d >{KEY_FILE} && chmod 0400 {KEY_FILE}", check=True, echo=False)
    vm.setup_salt(pillar(vm, SEED_ABOVE))
    return vm


@pytest.fixture(scope="module")
def unfiltered(vm):
    """An apply on a host whose LVM reads the LUNs through their paths as well as their maps:
    without udev in the guest LVM cannot tell the paths for multipath components."""
    sums = [vm.checksum(lun) for lun in range(LUNS)]
    applied = vm.salt("state.apply hana.storage", title="state.apply with LVM scanning the paths too")
    return applied, sums


def test_lvm_seeing_the_paths_of_the_maps_is_refused_before_anything_is_written(vm, unfiltered):
    """Regression (issue 29, item 15): every map was called blank, pvcreate ran on all of them,
    then vgcreate failed on duplicate PVs, and every later apply failed alike."""
    applied, sums = unfiltered
    guard = next(s for s in applied.ret.values() if s["__id__"] == "hana-storage-data-guard")
    assert guard["result"] is False and "LVM scans too" in guard["comment"], guard
    assert "global_filter" in guard["comment"] and "lvmdevices" in guard["comment"]
    assert f"{path(0, 0)[5:]}, {path(0, 1)[5:]}" in guard["comment"]  # the map's two paths, named
    # the SCAP data stream is put in place all the same: a scan of the refused host shows why
    changed = {s["__id__"] for s in applied.ret.values() if s["changes"]}
    assert changed <= {"hana-storage-scap-datastream"}, changed
    assert [vm.checksum(lun) for lun in range(LUNS)] == sums
    assert vm.run("pvs --noheadings 2>/dev/null | grep -c mpath", echo=False).output.strip() in ("", "0")


@pytest.fixture(scope="module")
def filtered(vm, unfiltered):
    vm.write("/etc/lvm/lvm.conf", LVM_CONF)


def test_each_lun_is_one_map_over_two_paths(vm):
    out = vm.run(
        f"echo $(cat /sys/block/vda/serial) $(cat /sys/block/{path(0, 1)[5:]}/serial); dmsetup table mpatha",
        echo=False,
    ).output
    assert out.split()[:2] == ["lun0", "lun0"] and " multipath " in out


@pytest.fixture(scope="module")
def above(vm, filtered):
    return vm.salt("state.apply hana.storage", title="state.apply: above LVM, -i 8 -I 128k over 8 maps")


def test_above_lvm_on_eight_luns_builds_and_audits_compliant(vm, above):
    assert above.retcode == 0, [s["comment"] for s in above.ret.values() if s["result"] is not True]
    lv = vm.salt("hana_storage.dm_tables", check=True).ret["vg_hana_data-lv_hana_data"][0]
    assert lv["target"] == "striped" and lv["stripes"] == 8 and lv["chunk_bytes"] == 128 * 1024
    devices = vm.run("lvs --noheadings -o devices vg_hana_data", echo=False).output
    assert all(f"/dev/mapper/{m}(" in devices for m in MAPS), devices
    audit = vm.salt("hana_storage.audit", check=True).ret
    assert audit["compliant"] is True, [f["message"] for f in audit["findings"]]


def test_lvm_scanning_the_paths_of_a_built_volume_is_layout_007(vm, above):
    vm.run("mv /etc/lvm/lvm.conf /run/lvm.conf.kept", check=True, echo=False)
    try:
        audit = vm.salt("hana_storage.audit", check=True).ret
    finally:
        vm.run("mv /run/lvm.conf.kept /etc/lvm/lvm.conf", check=True, echo=False)
    found = sorted(f["device"] for f in audit["findings"] if f["rule"] == "HANA-LAYOUT-007")
    assert found == [f"/dev/mapper/{m}" for m in MAPS], audit["findings"]


def boots_without_salt(vm, mountpoint, vg):
    vm.run(f"head -c 4M /dev/urandom >{mountpoint}/keep.bin && sync", check=True, echo=False)
    before = vm.run(f"sha256sum {mountpoint}/keep.bin", echo=False).output
    close_all(vm, mountpoint, vg)
    assert vm.run(f"findmnt {mountpoint}", echo=False).rc != 0
    out = boot_without_salt(vm)
    assert f"mounted {mountpoint}" in out, out
    assert vm.run(f"sha256sum {mountpoint}/keep.bin", echo=False).output == before
    audit = vm.salt("hana_storage.audit", check=True).ret
    assert audit["compliant"] is True, [f["message"] for f in audit["findings"]]
    return out


@pytest.mark.long  # make test-all
def test_above_lvm_boots_without_salt(vm, above):
    out = boots_without_salt(vm, "/hana/data", "vg_hana_data")
    assert "attach hana_data /dev/mapper/vg_hana_data-lv_hana_data" in out


@pytest.fixture(scope="module")
def below(vm, above):
    vm.run("umount /hana/data && cryptsetup close hana_data && vgchange -q -an vg_hana_data", check=True)
    vm.set_pillar(pillar(vm, SEED_BELOW))
    return vm.salt("state.apply hana.storage", title="state.apply: below LVM, LUKS2 on each of 8 maps")


def test_below_lvm_on_eight_luns_builds_and_audits_compliant(vm, below):
    assert below.retcode == 0, [s["comment"] for s in below.ret.values() if s["result"] is not True]
    tables = vm.salt("hana_storage.dm_tables", check=True).ret
    for i, name in enumerate(MAPS):
        (crypt,) = tables[f"hana_log_{i}"]
        assert crypt["sector_size"] == 4096 and crypt["flags"] == ["no_read_workqueue", "no_write_workqueue"]
        assert (
            vm.run(f"cryptsetup status hana_log_{i} | grep device:", echo=False).output.split()[-1]
            == f"/dev/mapper/{name}"
        )
    lv = tables["vg_hana_log-lv_hana_log"][0]
    assert lv["stripes"] == 8 and lv["chunk_bytes"] == 128 * 1024


def test_below_lvm_boots_without_salt_each_luks_on_its_map_never_on_a_path(vm, below):
    """Issue 33, multipath first: every path carries the LUN's LUKS header, so each crypttab
    line names its map's own link (it exists only once the map does), never UUID=."""
    crypttab = vm.run("cat /etc/crypttab", check=True, echo=False).output
    for i in range(LUNS):
        assert f"hana_log_{i} /dev/disk/by-id/dm-uuid-mpath-lun{i} " in crypttab, crypttab
    out = boots_without_salt(vm, "/hana/log", "vg_hana_log")
    for i, name in enumerate(MAPS):
        assert f"attach hana_log_{i} /dev/disk/by-id/dm-uuid-mpath-lun{i}" in out, out
        status = vm.run(f"cryptsetup status hana_log_{i} | grep device:", echo=False).output.split()
        assert status[-1] == f"/dev/mapper/{name}", status


def test_beacon_remediation_and_report_work_on_the_maps(vm, below):
    """The watch path on the maps: the beacon's full audit is compliant; flags dropped from the
    crypt device of one LUN are a violation on it; the safe fix restores them; the fleet report
    reads both audits."""
    tick = beacon_tick(vm)
    assert "raised" not in tick, tick.get("raised")
    (audit,) = [e for e in tick["events"] if e["tag"] == "audit"]
    assert audit["compliant"] is True and not [e for e in tick["events"] if e["tag"] == "violation"], tick
    vm.run(f"cryptsetup refresh --key-file {KEY_FILE} --persistent hana_log_3", check=True, echo=False)
    assert "no_read_workqueue" not in vm.run("dmsetup table hana_log_3", echo=False).output

    tick = beacon_tick(vm)
    violations = {(e["rule"], e["volume"], e["device"]) for e in tick["events"] if e["tag"] == "violation"}
    assert {rule for rule, _, _ in violations} >= {"HANA-PERF-002", "HANA-PERF-003"}, violations
    assert all(volume == "log" and "hana_log_3" in device for _, volume, device in violations), violations
    drifted = vm.salt("hana_storage.audit", check=True).ret
    row = hana_storage_report.fleet({"lun-host": {"ret": drifted, "retcode": 0}})["rows"][0]
    assert row["compliant"] == "NO" and "HANA-PERF-002" in row["rules"], row

    fixed = vm.salt("hana_storage.remediate", check=True).ret
    assert fixed["result"] is True, fixed
    assert "no_read_workqueue no_write_workqueue" in vm.run("dmsetup table hana_log_3", echo=False).output
    report = hana_storage_report.fleet(
        {"lun-host": {"ret": vm.salt("hana_storage.audit", check=True).ret, "retcode": 0}}
    )
    assert report["summary"] == {"minions": 1, "compliant": 1, "not_compliant": 0, "errors": 0}, report


def test_one_path_of_a_lun_used_directly_is_layout_005(vm, below):
    """The ninth LUN has no map: LUKS opened on one of its paths is what a host without
    multipath set up ends with."""
    direct = path(LUNS, 0)
    vm.run(
        f"set -e; cryptsetup luksFormat -q --type luks2 --pbkdf pbkdf2 --pbkdf-force-iterations 1000 "
        f"--sector-size 4096 --key-file {KEY_FILE} {direct}\n"
        f"cryptsetup open --key-file {KEY_FILE} {direct} hana_direct && mkfs.xfs -q /dev/mapper/hana_direct\n"
        "mkdir -p /hana/direct && mount /dev/mapper/hana_direct /hana/direct",
        check=True,
    )
    volume = {"direct": {"mountpoint": "/hana/direct", "devices": [direct], "crypt_name": "hana_direct"}}
    storage = yaml.safe_load(pillar(vm, volume))["hana"]["storage"]
    audit = vm.salt(f"hana_storage.audit pillar='{json.dumps(storage)}'", check=True).ret
    by_rule = {f["rule"]: f for f in audit["findings"]}
    assert by_rule["HANA-LAYOUT-005"]["device"] == direct, audit["findings"]


def test_a_pillar_naming_a_path_is_refused_and_told_the_map(vm, below):
    volume = {"path": {"mountpoint": "/hana/path", "devices": [path(0, 0)]}}
    storage = yaml.safe_load(pillar(vm, volume))["hana"]["storage"]
    audit = vm.salt(f"hana_storage.audit pillar='{json.dumps(storage)}'", check=True).ret
    naming = [f for f in audit["findings"] if f["rule"] == "HANA-LAYOUT-006"]
    assert naming and naming[0]["expected"] == "/dev/mapper/mpatha", audit["findings"]
    vm.set_pillar(pillar(vm, volume))
    dry = vm.salt("state.apply hana.storage test=True")
    guard = next(s for s in dry.ret.values() if s["__id__"] == "hana-storage-path-guard")
    assert guard["result"] is False and "in use by mpatha" in guard["comment"], guard
