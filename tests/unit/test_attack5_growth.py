"""Attacks on growing a volume online (lv_extended, crypt_grown, fs_grown, the pillar's growth
checks and the audit's LAYOUT-008/009). Each test states what should hold and fails while the
hole is open; the docstrings name the scenario."""

# ruff: noqa: F811 - the fixtures imported from test_states are parameters of the tests

import json
import os

import pytest
import salt.states.lvm as salt_lvm
from hana_storage_core import lvm, pillar

from tests.unit.test_growth import BUILT, pvs
from tests.unit.test_sls import rendered
from tests.unit.test_states import (  # noqa: F401  (fixtures: pytest finds them by name here)
    argvs_run,
    configure_loader_modules,
    dry_run,
    marks,
    opts,
    pillar_data,
    salt_functions,
    scratch,
    states,
    tabs,
)

LOG_LV = "/dev/vg_hana_log/lv_hana_log"
GIB = 1 << 30


def step_args(step):
    """An SLS step's arguments ([{name: value}, ...]) as keyword arguments, requisites left out."""
    return {k: v for arg in step for k, v in arg.items() if k != "require"}


def lv_steps(tmp_path, volume):
    """The rendered lvm.sls steps of a one-volume pillar ``data`` (above LVM)."""
    storage = {"volumes": {"data": {"mountpoint": "/hana/data", **volume}}}
    return rendered(tmp_path, storage, "lvm.sls")


# ---- 1. the XFS's size is read from a stale superblock ------------------------------------------


def xfs_host(salt_functions, superblock_bytes, mounted_bytes, grows_to=None):
    """The host during or after a growth: the device is 2 GiB; the superblock read through the
    block device says ``superblock_bytes`` however often it is read (the bdev page cache is not
    kept coherent with XFS's own buffers: a buffered read after xfs_growfs returns the old sector
    0, and even an O_DIRECT read does until the log writes the superblock back); the mounted
    filesystem (xfs_info / xfs_growfs -n: the XFS_IOC_FSGEOMETRY ioctl) says ``mounted_bytes``,
    after xfs_growfs -d ``grows_to``. Returns the argv of every command run."""
    salt_functions["hana_storage_host.xfs_superblock"].return_value = {"data_bytes": superblock_bytes}
    salt_functions["hana_storage_host.block_bytes"] = lambda path: 2 * GIB
    mounted = {"bytes": mounted_bytes}
    salt_functions["hana_storage_host.mounted_xfs_bytes"] = lambda mountpoint, dev=None: mounted["bytes"]
    ran = []

    def run_all(argv, **kwargs):
        ran.append(list(argv))
        if argv[0] == "xfs_growfs" and "-d" in argv:
            mounted["bytes"] = grows_to or mounted["bytes"]
        elif argv[0] in ("xfs_info", "xfs_growfs"):
            blocks = mounted["bytes"] // 4096
            geometry = f"data     =                       bsize=4096   blocks={blocks}, imaxpct=25\n"
            return {"retcode": 0, "stdout": geometry, "stderr": ""}
        return {"retcode": 0, "stdout": "", "stderr": ""}

    salt_functions["cmd.run_all"].side_effect = run_all
    return ran


@pytest.fixture
def mounted_log(monkeypatch):
    monkeypatch.setattr(states, "_live_mount", lambda mountpoint: {"dev": "253:4"})
    monkeypatch.setattr(states, "_dev_at", lambda path: "253:4")
    monkeypatch.setattr(states, "_dev_of", lambda path: "253:4")
    monkeypatch.setattr(states.os.path, "exists", lambda path: True)


def test_fs_grown_reports_the_size_the_xfs_has_after_growing(salt_functions, mounted_log):
    """xfs_growfs grew the XFS from 1 to 2 GiB; the superblock re-read from the block device is
    the stale one (verified on a loop device, Linux 6.18: a buffered pread of sector 0 still said
    the old dblocks 60 s later). The state reports {"old": 1 GiB, "new": 1 GiB}."""
    xfs_host(salt_functions, GIB, GIB, grows_to=2 * GIB)
    ret = states.fs_grown("/hana/log", "/dev/vg_hana_log/lv_hana_log")
    assert ret["result"] is True
    assert ret["changes"]["grown"]["new"] == 2 * GIB, ret


def test_a_second_apply_after_a_growth_does_not_grow_the_xfs_again(salt_functions, mounted_log):
    """The apply after the growth: the mounted XFS already fills its 2 GiB device, the superblock
    read through the page cache still says 1 GiB. fs_grown runs xfs_growfs again and reports a
    change on every apply (and the audit's HANA-LAYOUT-009, fed by the same read, keeps firing,
    so remediation loops)."""
    ran = xfs_host(salt_functions, GIB, 2 * GIB)
    ret = states.fs_grown("/hana/log", "/dev/vg_hana_log/lv_hana_log")
    assert ret["changes"] == {}, ret
    assert ["xfs_growfs", "-d", "/hana/log"] not in ran


# ---- 2. an absolute size is grown by Salt's lvm.lv_present, not by lv_extended -------------------


def lvdisplay(extents):
    lvpath = "/dev/vg_hana_data/lv_hana_data"
    return {
        lvpath: {
            "Current Logical Extents Associated": str(extents),
            "Logical Volume Size": str(extents * 8192),
        }
    }


@pytest.fixture
def core_lv(monkeypatch):
    """Salt's own lvm.lv_present (identical in 3006.30, 3007.17 and 3008.5) with an LVM whose LV
    exists; every lvresize it would run is recorded."""
    calls = {"lvresize": []}

    def configure(extents, test=False):
        monkeypatch.setattr(
            salt_lvm,
            "__salt__",
            {
                "lvm.lvdisplay": lambda path, quiet=False: lvdisplay(extents),
                "lvm.lvresize": lambda **kw: calls["lvresize"].append(kw) or {"Output from lvresize": "ok"},
                "lvm.lvcreate": lambda *a, **kw: pytest.fail("the LV exists"),
            },
            raising=False,
        )
        monkeypatch.setattr(salt_lvm, "__opts__", {"test": test}, raising=False)
        return calls

    return configure


def existing(salt_functions):
    """The VG and the LV exist; any command run on them fails the test."""
    segment = {"lv": "lv_hana_data", "vg": "vg_hana_data", "stripes": 2, "stripe_size": 65536}
    salt_functions["hana_storage_host.lv_segments"] = lambda path: {"segments": [segment]}
    salt_functions["hana_storage_host.vg_pvs"] = lambda vg: {"pvs": ["/dev/mapper/mpatha"]}
    salt_functions["cmd.run_all"].side_effect = lambda argv, **kw: pytest.fail(
        f"ran {argv} on an existing VG/LV"
    )


def test_a_larger_absolute_size_is_not_grown_by_salts_lv_present_outside_the_stripes(
    tmp_path, core_lv, salt_functions, monkeypatch
):
    """size 800M -> 1000M on a 2-stripe LV. The `lv` step (core lvm.lv_present) runs before
    lv-extended and calls `lvresize -qq -L 1000M` itself: no --stripes, no PV list (LVM picks any
    PV of the VG), and test=True showed lv-extended's lvextend commands, not this one. Fixed: the
    step (hana_storage.lv_present) only creates, with lvcreate, an LV that does not exist; what
    Salt's lv_present does to an existing LV is shown for the record."""
    steps = lv_steps(
        tmp_path,
        {"devices": ["/dev/mapper/mpatha", "/dev/mapper/mpathb"], "stripe_size": 64, "size": "1000M"},
    )
    calls = core_lv(200)  # 800 MiB
    salt_lvm.lv_present("lv_hana_data", vgname="vg_hana_data", size="1000M", stripes=2, stripesize="64k")
    assert calls["lvresize"], "Salt's lv_present resizes an existing LV"
    existing(salt_functions)
    ret = states.lv_present(**step_args(steps["hana-storage-data-lv"]["hana_storage.lv_present"]))
    assert ret["result"] is True and not ret["changes"], ret


def test_an_lv_rounded_up_to_whole_stripes_does_not_fail_every_later_apply(tmp_path, salt_functions):
    """size 2T over 3 stripes (README: 'size: 2T' grows the LV): 524288 extents are rounded up to
    524289 (whole stripes) by lvcreate/lvresize, and lv_extended rounds up the same way. Every
    later apply then sees 2T < the LV: core lv_present fails ('To reduce a Logical Volume option
    force must be True') and with it lv-active, LUKS above LVM, mkfs, mount, fs-grown..."""
    devices = ["/dev/mapper/mpatha", "/dev/mapper/mpathb", "/dev/mapper/mpathc"]
    steps = lv_steps(tmp_path, {"devices": devices, "stripe_size": 64, "size": "2T"})
    existing(salt_functions)  # nothing is run on the LV once it exists
    assert states.lv_present(**step_args(steps["hana-storage-data-lv"]["hana_storage.lv_present"]))["result"]
    rounded = [
        {"lv": "lv", "vg": "vg", "stripes": 3, "stripe_size": 65536, "size": 524289 << 22, "devices": devices}
    ]
    room = [{"pv": d, "free": 0, "extent_bytes": 4 << 20, "allocatable": True} for d in devices]
    assert lvm.extension("vg/lv", 3, 65536, "2T", rounded, room)["action"] == "none"


# ---- 3/4. test=True says 'would grow' when the apply would not --------------------------------------


def test_test_mode_with_stable_device_names_does_not_claim_a_growth_every_run(
    salt_functions, dry_run, monkeypatch
):
    """Above LVM the PVs are the pillar's devices, named (as HANA-LAYOUT-006 asks) by
    /dev/disk/by-id; LVM's `pvs` names them /dev/vda, /dev/vdb. lv_extended compares the strings,
    finds every pillar PV 'joining', and every test=True run says 'would grow' (result None)
    although the LV fills its VG and nothing would change."""
    by_id = {"/dev/disk/by-id/virtio-data0": "/dev/vda", "/dev/disk/by-id/virtio-data1": "/dev/vdb"}
    real = os.path.realpath
    monkeypatch.setattr(states.os.path, "realpath", lambda path, **kw: by_id.get(path) or real(path, **kw))
    salt_functions["hana_storage_host.lv_room"] = lambda name: {
        "segments": [{**BUILT[0], "devices": ["/dev/vda", "/dev/vdb"]}],
        "pvs": pvs(vda=0, vdb=0),
    }
    ret = states.lv_extended(LOG_LV, 2, 64, "100%FREE", pvs=list(by_id))
    assert ret["result"] is True and ret["changes"] == {}, ret["comment"]


@pytest.mark.parametrize(
    "stripe_kib,size,apply_result",
    [(64, "90%VG", True), (128, "100%FREE", False)],
    ids=["size-that-never-grows", "other-stripe-size"],
)
def test_test_mode_for_joining_pvs_says_what_the_apply_will_do(
    salt_functions, dry_run, stripe_kib, size, apply_result
):
    salt_functions["hana_storage_host.block_bytes"] = lambda path: 1 << 30  # the new LUNs, 1 GiB
    """New PVs c, d not in the VG yet: test=True answers 'would grow ... once they joined' before
    looking at the plan. But a volume sized 90%VG never grows (the apply says so, result True),
    and a pillar stripe_size other than the LV's is refused by the apply (result False) after
    luksFormat/pvcreate/vgextend of the new devices: test=True promises a growth in both."""
    salt_functions["hana_storage_host.lv_room"] = lambda name: {"segments": BUILT, "pvs": pvs(a=0, b=0)}
    ret = states.lv_extended(LOG_LV, 2, stripe_kib, size, pvs=["/dev/a", "/dev/b", "/dev/c", "/dev/d"])
    assert ret["result"] is apply_result, ret["comment"]


# ---- 5. lvextend onto PVs the pillar does not give the volume ----------------------------------------


def test_lv_extended_grows_only_onto_the_pillars_pvs(salt_functions):
    """The VG holds two PVs the pillar no longer gives this volume (taken out of its devices: a
    LUN being retired after pvmove, or moved to another volume's pillar). lv_extended plans over
    every PV of the VG with free extents and writes the LV's new segment onto them."""
    salt_functions["hana_storage_host.lv_room"] = lambda name: {
        "segments": BUILT,
        "pvs": pvs(a=0, b=0, x=100, y=100),
    }
    states.lv_extended(LOG_LV, 2, 64, "100%FREE", pvs=["/dev/a", "/dev/b"])
    ran = argvs_run(salt_functions)
    assert not [argv for argv in ran if "/dev/x" in argv or "/dev/y" in argv], ran


def test_the_pv_report_says_whether_a_pv_may_be_allocated():
    """`pvchange -x n` (a LUN being emptied with pvmove) leaves free extents LVM will not
    allocate; the PV report does not ask, so lv_extended plans an lvextend onto such a PV, LVM
    refuses it, and every apply fails."""
    fields = lvm.PV_ROOM_FIELDS.split(",")
    assert "pv_allocatable" in fields or "pv_attr" in fields, fields


# ---- 6/7/8. crashes ----------------------------------------------------------------------------------


def test_a_size_in_mib_without_a_unit_does_not_crash_lv_extended(tmp_path, salt_functions):
    """size: "800" (MiB: the schema allows it, size_bytes documents it) is rendered by lvm.sls as
    `- size: 800`, a YAML integer; lv_extended hands it to size_bytes' regex: TypeError."""
    steps = lv_steps(
        tmp_path, {"devices": ["/dev/mapper/mpatha", "/dev/mapper/mpathb"], "stripe_size": 64, "size": "800"}
    )
    kwargs = step_args(steps["hana-storage-data-lv-extended"]["hana_storage.lv_extended"])
    salt_functions["hana_storage_host.lv_room"] = lambda name: {"segments": BUILT, "pvs": pvs(a=0, b=0)}
    ret = states.lv_extended(**kwargs)
    assert ret["result"] is True, ret


def test_an_lv_whose_first_segment_has_no_stripes_does_not_crash_the_pillar_gate():
    """An LV of the pillar's name whose first segment is a virtual one (segtype error after
    `vgreduce --removemissing`, zero, thin: `lvs` reports 0 stripes, no devices): _growth_errors
    divides by its 0 stripes and validate_pillar (the gate of every apply) raises."""
    config = {"volumes": {"log": {"mountpoint": "/hana/log", "devices": ["/dev/mapper/mpatha"]}}}
    errors = pillar._growth_errors(config, {LOG_LV: {"stripes": 0, "stripe_size": 0, "pvs": 0}})
    assert isinstance(errors, list)


def test_a_pv_report_with_no_extent_size_is_malformed():
    """vg_extent_size "" or "0" parses as 0; an absolute size then divides by it in extension()."""
    row = {"pv_name": "/dev/a", "vg_name": "v", "pv_pe_count": "100", "pv_pe_alloc_count": "0",
           "dev_size": str(1 << 30), "pe_start": str(1 << 20), "pv_mda_count": "1", "pv_mda_size": "1044480"}  # fmt: skip
    for extent in ("", "0"):
        text = json.dumps({"report": [{"pv": [{**row, "vg_extent_size": extent}]}]})
        with pytest.raises(lvm.LvmReportError):
            lvm.parse_pv_room(text)


# ---- 9. an XFS sized smaller than its device on purpose is grown ------------------------------------


def test_an_xfs_data_size_the_pillar_sets_is_not_accepted_and_then_grown_away():
    """mkfs_options: ['-d size=500g'] passes the pillar; mkfs makes a 500 GiB XFS on the 2 TiB
    volume, then fs-grown (same apply) runs xfs_growfs to all of it, irreversibly (XFS cannot
    shrink), and HANA-LAYOUT-009 flags the layout the pillar asked for. Either refuse the option
    (as su/sw are) or leave such an XFS alone."""
    errors = pillar._options_errors({"mkfs_options": ["-d size=500g"]}, ("volumes", "data"))
    assert errors, "'-d size=' accepted, then undone by fs_grown"


# ---- 10. a stripe size change is refused only after the new devices were written ---------------


def test_new_devices_in_another_stripe_size_are_refused_by_the_pillar_gate():
    """8 devices, stripes 4, stripe_size 128 for an LV made 4 x 64 KiB: the gate passes it, so
    the new LUNs are luksFormatted (below LVM), pvcreated and vgextended before lv_extended
    refuses the geometry (README: refused 'before any device is touched')."""
    devices = [f"/dev/mapper/mpath{c}" for c in "abcdefgh"]
    config = {
        "volumes": {"log": {"mountpoint": "/hana/log", "devices": devices, "stripes": 4, "stripe_size": 128}}
    }
    lvs = {LOG_LV: {"stripes": 4, "stripe_size": 65536, "pvs": 4}}
    assert pillar._growth_errors(config, lvs) != []


# ---- 11. test=True runs vgextend --------------------------------------------------------------------


def test_test_mode_does_not_add_a_new_device_to_the_vg(tmp_path, salt_functions, dry_run):
    """Growth relied on Salt's lvm.vg_present to vgextend (README: 'a device new to the pillar
    joins the VG'). vg_present (3006.30/3007.17/3008.5 alike) checks __opts__['test'] only when
    the VG is absent: for an existing VG it runs `vgextend` on every pillar device that is an
    orphan PV (pvcreate'd by an apply that stopped before the vg step, or by the SAN team), with
    test=True as well. Fixed: the formula's vg_present only creates a VG that does not exist;
    its vg_extended adds PVs, and under test=True only says so."""
    devices = ["/dev/mapper/mpatha", "/dev/mapper/mpathb", "/dev/mapper/mpathc", "/dev/mapper/mpathd"]
    steps = lv_steps(tmp_path, {"devices": devices, "stripes": 2, "stripe_size": 64})
    existing(salt_functions)
    salt_functions["hana_storage_host.vg_pvs"] = lambda vg: {"pvs": devices[:2]}
    assert states.vg_present(**step_args(steps["hana-storage-data-vg"]["hana_storage.vg_present"]))["result"]
    extended = step_args(steps["hana-storage-data-vg-extended"]["hana_storage.vg_extended"])
    salt_functions["cmd.run_all"].side_effect = None
    ret = states.vg_extended(**extended)
    assert (
        ret["result"] is None
        and ret["comment"] == f"would run vgextend vg_hana_data {devices[2]} {devices[3]}"
    )
    assert argvs_run(salt_functions) == []
