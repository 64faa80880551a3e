"""A volume grown online by `state.apply hana.storage`, on a real kernel, while fio writes to it.

Two volumes on 1 GiB disks, each striped over two: data above LVM (vda, vdb), log below LVM
(vdc, vdd), a key file that unlocks at boot. Files with known checksums go on both; then, while
`fio --verify_backlog` writes and reads back on each mountpoint, the pillar gives each volume two
more devices (one more stripe set) and an apply grows them: below LVM luksFormat, open,
pvcreate, vgextend; above LVM pvcreate, vgextend; lvextend -i 2 -I 64k over the new PVs;
cryptsetup resize above LVM; xfs_growfs. Before that, device counts that would add a segment
in another geometry are refused with the counts named and nothing written. After it: two
segments of the same geometry per LV, the filesystems as large as their devices, fio saw no
corruption, checksums unchanged, the audit compliant, a second apply changes nothing, and the
storage comes back at a boot without Salt. Then LUNs grown in place under the running guest
(QEMU's block_resize): both stripes of each LV's first pair and one disk of the log's second pair
alone; test=True names each step and writes nothing; the apply runs cryptsetup resize (below
LVM) and pvresize per LUN and grows each LV by one segment in its own two stripes, leaving the
lone disk's room unused, while fio writes; checksums, audit, idempotence and a boot without
Salt as before. Last, the data volume grown by hand on two more disks
(vgextend, lvextend, cryptsetup resize) but not its XFS: HANA-LAYOUT-009, which
`hana_storage.remediate` fixes online (xfs_growfs), the proof of that auto rule's fix; then by
hand onto one more disk without stripes: a linear tail, HANA-LAYOUT-008. The LUNs grown in place
are `long` (make test-all).
"""

import re

import pytest
import yaml

from tests.vm.conftest import boot, boot_without_salt, close_storage, write_lab_key

pytestmark = pytest.mark.vm

KEY_FILE = "/etc/hana-storage/keys/hana.key"
FIRST = {"data": ["/dev/vda", "/dev/vdb"], "log": ["/dev/vdc", "/dev/vdd"]}
MORE = {"data": ["/dev/vde", "/dev/vdf"], "log": ["/dev/vdg", "/dev/vdh"]}
FILES = {"/hana/data/a.bin": 48, "/hana/log/b.bin": 24}  # MiB of random bytes
MOUNTS = ("/hana/data", "/hana/log")
LVS = {"data": "vg_hana_data/lv_hana_data", "log": "vg_hana_log/lv_hana_log"}
# fio on each mountpoint while the apply grows it: random 64 KiB writes, each block read back
# and checked (crc32c) soon after it is written, the first mismatch fatal. At 2 MiB/s a job: I/O
# in flight through every suspend and resume of the apply, without the emulated guest's one vCPU
# spent on encrypting as fast as it can (unbounded, the two growth applies took 79 and 65 s
# against 50 and 38 s, the module 503 s against 436 s: alone on the machine, one run each)
FIO = (
    "fio --name=grow{n} --filename={mount}/fio.bin --size=64M --rw=randwrite --bs=64k --rate=2m --ioengine=psync "
    "--direct=1 --verify=crc32c --verify_backlog=16 --verify_fatal=1 --time_based --runtime=1800 "
    "--output=/run/fio{n}.out >/dev/null 2>&1 & echo $! >/run/fio{n}.pid"
)


def pillar(vm, devices, **extra):
    storage = yaml.safe_load(vm.pillar())["hana"]["storage"]
    storage["key"] = {"source": "keyfile", "path": KEY_FILE}
    storage["volumes"] = {
        "data": {
            "mountpoint": "/hana/data",
            "devices": devices["data"],
            "stripe_size": 64,
            **extra.get("data", {}),
        },
        "log": {
            "mountpoint": "/hana/log",
            "devices": devices["log"],
            "encryption": "below_lvm",
            "stripe_size": 64,
            **extra.get("log", {}),
        },
    }
    return yaml.safe_dump({"hana": {"storage": storage}})


def grown_devices():
    return {name: FIRST[name] + MORE[name] for name in FIRST}


def grown_pillar(vm, devices=None):
    """Four devices each, in the LVs' own two stripes (without ``stripes`` that is refused)."""
    return pillar(vm, devices or grown_devices(), data={"stripes": 2}, log={"stripes": 2})


def failures(applied):
    return [s["comment"] for s in applied.ret.values() if s["result"] is not True]


def sums(vm):
    return vm.run(f"sha256sum {' '.join(FILES)}", check=True, echo=False).output


def segments(vm, lv):
    """[(stripes, stripe size in bytes, devices)] of the LV's segments."""
    out = vm.run(
        f"lvs --noheadings --segments --units b --nosuffix -o stripes,stripe_size,devices {lv}",
        check=True,
        echo=False,
    ).output
    return [
        (int(s), int(size), devs) for s, size, devs in (line.split() for line in out.strip().splitlines())
    ]


def sizes(vm, mount):
    """(bytes of the device mounted at ``mount``, bytes of the XFS data section on it)."""
    out = vm.run(
        f"dev=$(findmnt -n -o SOURCE {mount}); blockdev --getsize64 $dev; "
        f"xfs_info {mount} | sed -n 's/^data *= *bsize=\\([0-9]*\\) *blocks=\\([0-9]*\\).*/\\1 \\2/p'",
        check=True,
        echo=False,
    ).output.split()
    return int(out[0]), int(out[1]) * int(out[2])


@pytest.fixture(scope="module")
def vm(request):
    vm = boot(request, disks=11, disk_size="1G")  # mkfs.xfs needs volumes over 300 MB
    write_lab_key(vm, KEY_FILE)
    vm.setup_salt(pillar(vm, FIRST))
    built = vm.salt("state.apply hana.storage", title="state.apply: data and log, two devices each")
    assert built.retcode == 0, failures(built)
    vm.run(
        "set -e\n"
        + "".join(f"head -c {mib}M /dev/urandom >{path}\n" for path, mib in FILES.items())
        + "sync",
        check=True,
        title="checksummed files on both volumes",
    )
    vm.sums = sums(vm)
    vm.before = {name: sizes(vm, f"/hana/{name}") for name in FIRST}
    return vm


@pytest.mark.parametrize(
    "extra,devices,where,words",
    [
        # three devices in two stripes: one device would carry a stripe alone
        ({"data": {"stripes": 2}}, {"data": FIRST["data"] + ["/dev/vde"]}, "volumes:data:devices",
         "3 devices cannot carry 2 stripes evenly: give it a multiple of 2 devices (2, 4)"),
        # new devices without stripes: one per device would be 3, the LV has 2
        ({}, {"log": FIRST["log"] + ["/dev/vdg"]}, "volumes:log:stripes",
         "has 2 stripe(s) over 2 devices; 1 new device(s) in 3 stripes would add a 3-stripe segment: "
         "set stripes: 2 and give it a multiple of 2 devices (2, 4)"),
    ],
    ids=["uneven", "other-geometry"],
)  # fmt: skip
def test_a_growth_in_another_geometry_is_refused_before_anything_is_written(vm, extra, devices, where, words):
    new_disk = 4 if "data" in devices else 6  # vde, vdg: the device that would have been added
    before = vm.checksum(new_disk)
    vm.set_pillar(pillar(vm, {**FIRST, **devices}, **extra))
    try:
        refused = vm.salt("state.apply hana.storage", title=f"state.apply with {where} wrong")
    finally:
        vm.set_pillar(pillar(vm, FIRST))
    assert refused.retcode != 0
    gate = next(s for s in refused.ret.values() if s["__id__"] == "hana-storage-pillar-valid")
    assert f"hana:storage:{where}: " in gate["comment"] and words in gate["comment"], gate["comment"]
    changed = {s["__id__"] for s in refused.ret.values() if s["changes"]}
    assert changed == set(), changed
    assert vm.checksum(new_disk) == before
    assert [len(segments(vm, lv)) for lv in LVS.values()] == [1, 1]


def test_test_mode_names_each_growth_step_and_writes_nothing(vm):
    vm.set_pillar(grown_pillar(vm))
    new_disks = [vm.checksum(n) for n in range(4, 8)]
    dry = vm.salt("state.apply hana.storage test=True", title="state.apply test=True, growing")
    would = {s["__id__"]: s["comment"] for s in dry.ret.values() if s["result"] is None}
    assert "hana-storage-log-luks-2" in would and "hana-storage-log-luks-3" in would, would
    assert would["hana-storage-data-vg-extended"] == "would run vgextend vg_hana_data /dev/vde /dev/vdf", (
        would
    )
    data, log = would["hana-storage-data-lv-extended"], would["hana-storage-log-lv-extended"]
    assert data.startswith("would grow /dev/vg_hana_data/lv_hana_data online by "), would
    assert "once /dev/vde, /dev/vdf joined its VG" in data, would
    assert data.endswith("--stripes 2 --stripesize 64k vg_hana_data/lv_hana_data /dev/vde /dev/vdf"), would
    assert "once /dev/mapper/hana_log_2, /dev/mapper/hana_log_3 joined its VG" in log, would
    assert all(not s["changes"] for s in dry.ret.values())
    assert [vm.checksum(n) for n in range(4, 8)] == new_disks


def apply_while_fio_writes(vm, title):
    """``state.apply`` with fio writing and verifying on each mountpoint meanwhile: (its result,
    fio's output once both jobs were stopped after it)."""
    vm.run(
        "".join(FIO.format(n=n, mount=m) + "\n" for n, m in enumerate(MOUNTS)),
        check=True,
        title="fio writing",
    )
    applied = vm.salt("state.apply hana.storage", title=title)
    # both fio jobs ran through the whole apply; stopped now, each must have ended without error
    fio = vm.run(
        "for n in 0 1; do kill -0 $(cat /run/fio$n.pid) && echo RUNNING$n; kill -INT $(cat /run/fio$n.pid); done\n"
        "for n in 0 1; do while kill -0 $(cat /run/fio$n.pid) 2>/dev/null; do sleep 0.5; done; cat /run/fio$n.out; done",
        title="stopping fio",
        timeout=600,
    ).output
    return applied, fio


def assert_fio_saw_no_error(fio):
    assert "RUNNING0" in fio and "RUNNING1" in fio, fio  # still writing when the apply returned
    assert fio.count("err= 0") == 2 and "verify" not in fio.lower().replace("verify_backlog", ""), fio


@pytest.fixture(scope="module")
def grown(vm):
    """The apply that grows both volumes, with fio writing and verifying on each meanwhile."""
    vm.set_pillar(grown_pillar(vm))
    return apply_while_fio_writes(vm, "state.apply: two more devices for each volume")


def test_the_apply_grows_each_volume_online_in_its_own_stripes(vm, grown):
    applied, _ = grown
    assert applied.retcode == 0, failures(applied)
    changes = {s["__id__"]: s["changes"] for s in applied.ret.values() if s["changes"]}
    for name in FIRST:
        assert changes[f"hana-storage-{name}-lv-extended"]["extended"]["stripes"] == 2, changes
        assert "grown" in changes[f"hana-storage-{name}-fs-grown"], changes
    assert "resized" in changes["hana-storage-data-crypt-grown"], changes
    assert not [i for i, c in changes.items() if {"formatted", "wiped"} & set(c) and "log-luks-" not in i], (
        changes
    )
    for lv in LVS.values():
        found = segments(vm, lv)
        assert [(s, size) for s, size, _ in found] == [(2, 65536), (2, 65536)], found
        assert set(re.findall(r"/dev/[\w/]+", found[1][2])).isdisjoint(
            re.findall(r"/dev/[\w/]+", found[0][2])
        )
    for name in FIRST:
        device, fs = sizes(vm, f"/hana/{name}")
        assert device > 1.8 * vm.before[name][0], (name, device, vm.before)
        assert device - fs < 64 << 20, (name, device, fs)


def test_fio_saw_every_block_it_wrote_while_the_volumes_grew(grown):
    _, fio = grown
    assert_fio_saw_no_error(fio)


def test_the_data_is_unchanged_and_the_audit_compliant(vm, grown):
    assert sums(vm) == vm.sums
    report = vm.salt("hana_storage.audit", check=True).ret
    assert report["compliant"] is True, report["findings"]


def test_a_second_apply_changes_nothing(vm, grown):
    again = vm.salt("state.apply hana.storage", title="state.apply again")
    assert again.retcode == 0, failures(again)
    changed = {s["__id__"]: s["changes"] for s in again.ret.values() if s["changes"]}
    assert changed == {}, changed


def test_the_grown_volumes_come_back_at_a_boot_without_salt(vm, grown):
    close_storage(vm, list(MOUNTS), ["vg_hana_data", "vg_hana_log"])
    boot_without_salt(vm)
    assert sums(vm) == vm.sums
    assert vm.salt("hana_storage.audit", check=True).ret["compliant"] is True


# ---- LUNs grown in place -------------------------------------------------------------------------
# Grown under the running guest (QEMU's block_resize, as a SAN resizes a LUN or a cloud a volume):
# each stripe of the LVs' first segment, data above LVM (vda, vdb) and log below it (vdc, vdd
# under hana_log_0 and _1), and one of the log's second pair alone (vdg under hana_log_2).
LUNS = {0: "/dev/vda", 1: "/dev/vdb", 2: "/dev/vdc", 3: "/dev/vdd", 6: "/dev/vdg"}
LUN_BYTES = 1536 << 20


@pytest.fixture(scope="module")
def luns_grown(vm, grown):
    vm.layout_before = {name: segments(vm, lv) for name, lv in LVS.items()}
    vm.sizes_before = {name: sizes(vm, f"/hana/{name}") for name in FIRST}
    for index in LUNS:
        vm.resize_disk(index, LUN_BYTES)
    seen = vm.run(f"blockdev --getsize64 {' '.join(LUNS.values())}", check=True, echo=False).output.split()
    assert seen == [str(LUN_BYTES)] * len(LUNS), seen
    disks = [vm.checksum(n) for n in LUNS]
    dry = vm.salt("state.apply hana.storage test=True", title="state.apply test=True, LUNs grown in place")
    vm.dry_disks = (disks, [vm.checksum(n) for n in LUNS])
    return (dry, *apply_while_fio_writes(vm, "state.apply: LUNs grown in place"))


@pytest.mark.long  # make test-all
def test_test_mode_names_each_lun_growth_and_writes_nothing(vm, luns_grown):
    dry, _, _ = luns_grown
    would = {s["__id__"]: s["comment"] for s in dry.ret.values() if s["result"] is None}
    assert "pvresize /dev/vda (" in would["hana-storage-data-lun-grown-0"], would
    for n in (0, 1, 2):  # below LVM: the LUKS device first, with the key on a file
        assert would[f"hana-storage-log-lun-grown-{n}"].startswith(
            f"would grow /dev/mapper/hana_log_{n} with {LUNS[(2, 3, 6)[n]]}: "
            f"cryptsetup resize --key-file {KEY_FILE} hana_log_{n} ("
        ), would
    assert "grew with its LUN" in would["hana-storage-data-lv-extended"], would
    assert "hana-storage-data-lun-grown-2" not in would, would  # vde did not grow
    assert all(not s["changes"] for s in dry.ret.values())
    before, after = vm.dry_disks
    assert before == after


@pytest.mark.long  # make test-all
def test_the_apply_carries_each_grown_lun_up_to_the_filesystem_in_whole_stripes(vm, luns_grown):
    _, applied, _ = luns_grown
    assert applied.retcode == 0, failures(applied)
    changes = {s["__id__"]: s["changes"] for s in applied.ret.values() if s["changes"]}
    for n in (0, 1):
        assert set(changes[f"hana-storage-data-lun-grown-{n}"]["grown"]) == {"pv"}, changes
    for n in (0, 1, 2):
        assert set(changes[f"hana-storage-log-lun-grown-{n}"]["grown"]) == {"crypt", "pv"}, changes
    for name in FIRST:
        found = segments(vm, LVS[name])
        # one more segment in the LV's own two stripes, over the first pair only: the third PV
        # that grew (hana_log_2) has no partner, and its room stays unused
        assert found[:-1] == vm.layout_before[name], found
        assert (found[-1][0], found[-1][1]) == (2, 65536), found
        assert found[-1][2].count("(") == 2 and found[0][2].split(",")[0].split("(")[0] in found[-1][2], found
        device, fs = sizes(vm, f"/hana/{name}")
        assert device > vm.sizes_before[name][0] + (900 << 20), (name, device, vm.sizes_before)
        assert device - fs < 64 << 20, (name, device, fs)


@pytest.mark.long  # make test-all
def test_fio_saw_every_block_it_wrote_while_the_luns_grew(luns_grown):
    _, _, fio = luns_grown
    assert_fio_saw_no_error(fio)


@pytest.mark.long  # make test-all
def test_after_the_luns_grew_the_data_is_unchanged_the_audit_compliant_and_nothing_left(vm, luns_grown):
    assert sums(vm) == vm.sums
    assert vm.salt("hana_storage.audit", check=True).ret["compliant"] is True
    again = vm.salt("state.apply hana.storage", title="state.apply again")
    assert again.retcode == 0, failures(again)
    changed = {s["__id__"]: s["changes"] for s in again.ret.values() if s["changes"]}
    assert changed == {}, changed


@pytest.mark.long  # make test-all
def test_the_grown_luns_come_back_at_a_boot_without_salt(vm, luns_grown):
    grown_to = {name: sizes(vm, f"/hana/{name}") for name in FIRST}
    close_storage(vm, list(MOUNTS), ["vg_hana_data", "vg_hana_log"])
    boot_without_salt(vm)
    assert sums(vm) == vm.sums
    assert {name: sizes(vm, f"/hana/{name}") for name in FIRST} == grown_to
    assert vm.salt("hana_storage.audit", check=True).ret["compliant"] is True


def test_an_xfs_left_ungrown_by_hand_is_found_and_remediated_online(vm, grown):
    by_hand = ["/dev/vdi", "/dev/vdj"]
    vm.set_pillar(grown_pillar(vm, {**grown_devices(), "data": grown_devices()["data"] + by_hand}))
    vm.run(
        f"set -e\npvcreate -q {' '.join(by_hand)}\nvgextend -q vg_hana_data {' '.join(by_hand)}\n"
        "lvextend -q -i 2 -I 64k -l +100%FREE vg_hana_data/lv_hana_data\n"
        f"cryptsetup resize --key-file {KEY_FILE} hana_data",
        check=True,
        title="growing the data volume by hand, all but its XFS",
    )
    found = vm.salt("hana_storage.audit", check=True).ret["findings"]
    assert [(f["rule"], f["device"]) for f in found] == [("HANA-LAYOUT-009", "/dev/mapper/hana_data")], found
    fixed = vm.salt("hana_storage.remediate", title="hana_storage.remediate: xfs_growfs").ret
    assert [f["rule"] for f in fixed["fixed"]] == ["HANA-LAYOUT-009"] and fixed["result"] is True, fixed
    device, fs = sizes(vm, "/hana/data")
    assert device - fs < 64 << 20, (device, fs)
    assert vm.salt("hana_storage.audit", check=True).ret["compliant"] is True
    assert sums(vm) == vm.sums


def test_a_linear_tail_grown_by_hand_is_found(vm, grown):
    """lvextend without -i onto one more disk (outside the pillar: a growth by hand or by
    another tool): the LV's new segment has one stripe. HANA-LAYOUT-008, and nothing else."""
    vm.run(
        "set -e\npvcreate -q /dev/vdk\nvgextend -q vg_hana_data /dev/vdk\n"
        "lvextend -q -i 1 -l +100%FREE vg_hana_data/lv_hana_data /dev/vdk",
        check=True,
        title="a linear tail on the data LV, by hand",
    )
    assert [s for s, _size, _devices in segments(vm, LVS["data"])][-1] == 1
    found = vm.salt("hana_storage.audit", check=True).ret["findings"]
    assert [f["rule"] for f in found] == ["HANA-LAYOUT-008"], found
    assert "lv_hana_data" in found[0]["device"], found
