"""A LUN grown in place (a SAN LUN resized, a cloud volume made larger): the plan that carries
its size up to the PV (pure), the PV report's fields it needs, the lun_grown state through
Salt's loader dunders, lv_extended's test-mode estimate, and lvm.sls. The real growth, with a
disk resized under a running guest, is tests/vm/test_grow.py."""

# ruff: noqa: F811 - the fixtures imported from test_states are parameters of the tests

import json

import pytest
from hana_storage_core import lun, lvm

from tests.unit.test_growth import BUILT, pvs
from tests.unit.test_sls import rendered, requires
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
)

MIB, MIB4 = 1 << 20, 4 << 20
KEY = "/etc/hana-storage/keys/hana.key"


def room(extents, device_bytes, mdas=1, vg="vg_hana_log", pv="/dev/vda"):
    """A PV as lvm.parse_pv_room gives it (pvcreate's defaults: 1 MiB before the first extent)."""
    return {"pv": pv, "vg": vg, "extents": extents, "free": 0, "allocatable": True, "extent_bytes": MIB4,
            "device_bytes": device_bytes, "pe_start": MIB, "end_metadata_bytes": 1044480 if mdas > 1 else 0}  # fmt: skip


# ---- pure: the extents a PV holds after pvresize, and the plan ---------------------------------------


@pytest.mark.parametrize(
    "device_bytes,mdas,extents",
    # measured: pvcreate (--pvmetadatacopies 2), vgcreate, the loop device grown, pvresize, pvs
    [(104857600, 1, 24), (157286400, 1, 37), (157286400, 2, 37), (212860928, 2, 50)],
)
def test_the_extents_after_pvresize_are_what_lvm_made_of_them(device_bytes, mdas, extents):
    assert lun.pv_extents_at(room(0, 0, mdas), device_bytes) == extents


def facts(device_bytes=1 << 30, paths=None, crypt=None, pv=None):
    return {"device": "/dev/mapper/mpatha", "device_bytes": device_bytes, "paths": paths or {},
            "crypt": crypt, "pv": pv}  # fmt: skip


def test_a_lun_that_did_not_grow_needs_nothing():
    found = lun.plan(facts(pv=room(255, 1 << 30)))
    assert found == {"steps": [], "adds_extents": 0}


def test_a_grown_multipath_lun_resizes_the_map_then_the_pv():
    found = lun.plan(facts(1 << 30, paths={"sdb": 2 << 30, "sdc": 2 << 30}, pv=room(255, 1 << 30)))
    assert found["steps"] == [
        {"step": "map", "from": 1 << 30, "to": 2 << 30},
        {"step": "pv", "from": 255, "to": 511},
    ]
    assert found["adds_extents"] == 256


def test_paths_of_one_lun_that_disagree_are_refused_naming_the_rescan():
    with pytest.raises(lun.LunError, match=r"sdb 2147483648 bytes, sdc 1073741824 bytes.*device/rescan"):
        lun.plan(facts(1 << 30, paths={"sdb": 2 << 30, "sdc": 1 << 30}, pv=room(255, 1 << 30)))


@pytest.mark.parametrize(
    "shrunk",
    [
        facts(1 << 30, paths={"sdb": 512 * MIB, "sdc": 512 * MIB}),
        facts(
            512 * MIB, crypt={"name": "hana_log_0", "bytes": (1 << 30) - 16 * MIB, "offset_bytes": 16 * MIB}
        ),
        facts(0),
    ],
    ids=["paths", "crypt", "unread"],
)
def test_a_lun_that_shrank_or_cannot_be_read_is_refused(shrunk):
    with pytest.raises(lun.LunError):
        lun.plan(shrunk)


def test_below_lvm_the_luks_device_grows_before_the_pv():
    crypt = {"name": "hana_log_0", "bytes": (1 << 30) - 16 * MIB, "offset_bytes": 16 * MIB}
    found = lun.plan(facts(2 << 30, crypt=crypt, pv=room(251, (1 << 30) - 16 * MIB)))
    assert [s["step"] for s in found["steps"]] == ["crypt", "pv"]
    assert found["steps"][0] == {"step": "crypt", "from": (1 << 30) - 16 * MIB, "to": (2 << 30) - 16 * MIB}
    assert found["adds_extents"] == ((2 << 30) - 17 * MIB) // MIB4 - 251


def test_a_pv_in_no_vg_yet_is_not_resized():
    assert lun.plan(facts(2 << 30, pv=room(0, 1 << 30, vg=""))) == {"steps": [], "adds_extents": 0}


def test_the_pv_report_gives_the_device_size_and_the_metadata_areas():
    row = {"pv_name": "/dev/vda", "vg_name": "v", "pv_pe_count": "37", "pv_pe_alloc_count": "0",
           "pv_allocatable": "allocatable", "vg_extent_size": str(MIB4), "dev_size": "212860928",
           "pe_start": str(MIB), "pv_mda_count": "2", "pv_mda_size": "1044480"}  # fmt: skip
    (pv,) = lvm.parse_pv_room(json.dumps({"report": [{"pv": [row]}]}))
    assert (pv["device_bytes"], pv["pe_start"], pv["end_metadata_bytes"]) == (212860928, MIB, 1044480)
    assert lun.pv_extents_at(pv, pv["device_bytes"]) == 50
    for field in ("dev_size", "pe_start", "pv_mda_count"):
        partial = {k: v for k, v in row.items() if k != field}
        with pytest.raises(lvm.LvmReportError):
            lvm.parse_pv_room(json.dumps({"report": [{"pv": [partial]}]}))


# ---- the state --------------------------------------------------------------------------------------

MPATH, CRYPT_PV = "/dev/mapper/mpatha", "/dev/mapper/hana_log_0"
BELOW = {"steps": [{"step": "map", "from": 1 << 30, "to": 2 << 30}, {"step": "crypt", "from": 1, "to": 2},
                   {"step": "pv", "from": 251, "to": 507}], "adds_extents": 256, "map": "mpatha"}  # fmt: skip
DONE = {"steps": [], "adds_extents": 0, "map": "mpatha"}


@pytest.fixture
def lun_host(salt_functions, monkeypatch):
    """lun_growth says BELOW until each of its commands ran, then DONE; the PV is there."""
    monkeypatch.setattr(states.os.path, "exists", lambda path: True)
    ran = salt_functions["cmd.run_all"]
    salt_functions["hana_storage_host.lun_growth"] = lambda device, pv: DONE if ran.call_count >= 3 else BELOW
    return salt_functions


def test_lun_grown_resizes_map_luks_and_pv_in_that_order_with_the_key_on_a_file(lun_host):
    ret = states.lun_grown(MPATH, CRYPT_PV, KEY)
    assert ret["result"] is True, ret
    assert argvs_run(lun_host) == [
        ["multipathd", "resize", "map", "mpatha"],
        ["cryptsetup", "resize", "--key-file", KEY, "hana_log_0"],
        ["pvresize", CRYPT_PV],
    ]
    assert ret["changes"]["grown"]["pv"] == {"old": 251, "new": 507}


def test_lun_grown_in_test_mode_names_each_command_and_runs_none(lun_host, dry_run):
    ret = states.lun_grown(MPATH, CRYPT_PV, KEY)
    assert ret["result"] is None and ret["changes"] == {}
    assert (
        "multipathd resize map mpatha" in ret["comment"]
        and f"pvresize {CRYPT_PV} (251 to 507 extents)" in ret["comment"]
    )
    assert argvs_run(lun_host) == []


def test_lun_grown_with_nothing_grown_runs_nothing(salt_functions, monkeypatch):
    monkeypatch.setattr(states.os.path, "exists", lambda path: True)
    salt_functions["hana_storage_host.lun_growth"] = lambda device, pv: DONE
    ret = states.lun_grown(MPATH, MPATH)
    assert ret["result"] is True and ret["changes"] == {} and "spans all of" in ret["comment"]
    assert argvs_run(salt_functions) == []


@pytest.mark.parametrize("test", [True, False], ids=["test", "apply"])
def test_lun_grown_refuses_what_the_plan_refuses_and_touches_nothing(salt_functions, monkeypatch, opts, test):
    opts["test"] = test
    monkeypatch.setattr(states.os.path, "exists", lambda path: True)
    salt_functions["hana_storage_host.lun_growth"] = lambda device, pv: {
        "error": "the paths of X differ in size"
    }
    ret = states.lun_grown(MPATH, MPATH)
    assert ret["result"] is False and "Nothing was changed" in ret["comment"]
    assert argvs_run(salt_functions) == []


def test_lun_grown_fails_when_a_command_did_not_take(salt_functions, monkeypatch):
    """multipathd answers "fail" on its socket with exit code 0 on some versions: what counts is
    the size read afterwards."""
    monkeypatch.setattr(states.os.path, "exists", lambda path: True)
    salt_functions["hana_storage_host.lun_growth"] = lambda device, pv: {**BELOW, "steps": BELOW["steps"][:1]}
    ret = states.lun_grown(MPATH, MPATH)
    assert ret["result"] is False and "not done" in ret["comment"], ret


def test_below_lvm_a_lun_under_re_encryption_is_left_as_it_is(lun_host):
    """Its mapping is cryptsetup's hotzone stack meanwhile, no crypt target on the LUN: found
    when the VM tier re-encrypted PVs online (the state said "not an open crypt mapping"), and by
    attack review 20 (multipathd resize, then cryptsetup resize against the stack)."""
    lun_host["hana_storage_host.luks_header"].return_value = {"reencryption": {"mode": "reencrypt"}}
    ret = states.lun_grown(MPATH, CRYPT_PV, KEY)
    assert ret["result"] is True and "under LUKS2 re-encryption" in ret["comment"], ret
    assert argvs_run(lun_host) == []


def test_lun_grown_before_the_pv_exists_is_nothing_in_test_mode(salt_functions, monkeypatch, dry_run):
    monkeypatch.setattr(states.os.path, "exists", lambda path: False)
    ret = states.lun_grown(MPATH, CRYPT_PV, KEY)
    assert ret["result"] is True and "not there yet" in ret["comment"]


def test_lv_extended_in_test_mode_counts_the_room_a_pending_lun_growth_brings(
    salt_functions, monkeypatch, dry_run
):
    salt_functions["hana_storage_host.lv_room"] = lambda name: {"segments": BUILT, "pvs": pvs(a=0, b=0)}
    salt_functions["hana_storage_host.lun_growth"] = lambda device, pv: {**DONE, "adds_extents": 50}
    running = {"lun-a": {"__id__": "lun-a", "result": None}, "lun-b": {"__id__": "lun-b", "result": None}}
    monkeypatch.setattr(states, "__running__", running, raising=False)
    ret = states.lv_extended("/dev/vg_hana_log/lv_hana_log", 2, 64, "100%FREE", ["/dev/a", "/dev/b"],
                             grown_by=["lun-a", "lun-b"])  # fmt: skip
    assert ret["result"] is None, ret
    assert "once /dev/a, /dev/b grew with its LUN (their room estimated)" in ret["comment"]
    assert "lvextend --extents +100 --stripes 2" in ret["comment"]
    assert argvs_run(salt_functions) == []


# ---- lvm.sls -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("encryption", ["above_lvm", "below_lvm"])
def test_each_pv_grows_with_its_lun_before_the_lv_grows(tmp_path, encryption):
    devices = ["/dev/mapper/mpatha", "/dev/mapper/mpathb"]
    storage = {"volumes": {"log": {"mountpoint": "/hana/log", "devices": devices, "encryption": encryption}}}
    steps = rendered(tmp_path, storage, "lvm.sls")
    for n, device in enumerate(devices):
        (args,) = steps[f"hana-storage-log-lun-grown-{n}"].values()
        given = {k: v for arg in args for k, v in arg.items() if k != "require"}
        assert given["name"] == device
        assert ("key_file" in given) == (encryption == "below_lvm")
        assert given["pv"] == (device if encryption == "above_lvm" else f"/dev/mapper/hana_log_{n}")
    (extend,) = steps["hana-storage-log-lv-extended"].values()
    assert {f"hana-storage-log-lun-grown-{n}" for n in range(2)} <= set(requires(extend))
    given = {k: v for arg in extend for k, v in arg.items() if k != "require"}
    assert given["grown_by"] == ["hana-storage-log-lun-grown-0", "hana-storage-log-lun-grown-1"]
