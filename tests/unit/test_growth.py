"""Growing a volume online: the extension plan (pure), the pillar's refusals, and the three
states (lv_extended, crypt_grown, fs_grown) through Salt's loader dunders. The real growth, with
fio writing and checksums, is tests/vm/test_grow.py."""

import pytest
from hana_storage_core import lvm, pillar

MIB4 = 4 << 20


def segment(stripes, size_extents, devices, stripe_kib=64):
    return {
        "lv": "lv_hana_log",
        "vg": "vg_hana_log",
        "stripes": stripes,
        "stripe_size": stripe_kib * 1024 if stripes > 1 else 0,
        "size": size_extents * MIB4,
        "devices": devices,
    }


def pvs(**free):
    return [{"pv": f"/dev/{pv}", "vg": "vg_hana_log", "extents": 100, "free": n, "allocatable": True,
             "extent_bytes": MIB4} for pv, n in free.items()]  # fmt: skip


BUILT = [segment(2, 200, ["/dev/a", "/dev/b"])]


def test_two_new_pvs_grow_a_two_stripe_lv_by_one_striped_segment():
    plan = lvm.extension("vg_hana_log/lv_hana_log", 2, 65536, "100%FREE", BUILT, pvs(a=0, b=0, c=100, d=100))
    assert plan["action"] == "extend" and plan["adds_bytes"] == 200 * MIB4
    assert plan["argv"] == [
        ["lvextend", "--extents", "+200", "--stripes", "2", "--stripesize", "64k", "vg_hana_log/lv_hana_log",
         "/dev/c", "/dev/d"],
    ]  # fmt: skip


def test_four_new_pvs_give_two_segments_each_over_two_pvs():
    plan = lvm.extension("vg/lv", 2, 65536, "100%FREE", BUILT, pvs(a=0, b=0, c=100, d=100, e=100, f=100))
    assert [argv[-2:] for argv in plan["argv"]] == [["/dev/c", "/dev/d"], ["/dev/e", "/dev/f"]]
    assert plan["adds_bytes"] == 400 * MIB4


def test_free_space_on_fewer_pvs_than_stripes_is_left_and_named():
    plan = lvm.extension("vg/lv", 2, 65536, "100%FREE", BUILT, pvs(a=0, b=0, c=100))
    assert plan["action"] == "none" and plan["argv"] == []
    assert "cannot be striped 2 ways" in plan["reason"] and "/dev/c" in plan["reason"]


def test_unequal_new_luns_grow_by_the_smaller_and_then_stop():
    plan = lvm.extension("vg/lv", 2, 65536, "100%FREE", BUILT, pvs(a=0, b=0, c=100, d=60))
    assert plan["argv"][0][2] == "+120" and len(plan["argv"]) == 1
    # the next apply: 40 extents on one PV, nothing to stripe: idempotent
    again = lvm.extension("vg/lv", 2, 65536, "100%FREE", BUILT, pvs(a=0, b=0, c=40, d=0))
    assert again["action"] == "none"


def test_an_lv_that_fills_its_vg_is_left_alone():
    assert (
        lvm.extension("vg/lv", 2, 65536, "100%FREE", BUILT, pvs(a=0, b=0))["reason"] == "vg/lv fills its VG"
    )


def test_growth_in_another_geometry_is_refused():
    plan = lvm.extension("vg/lv", 4, 65536, "100%FREE", BUILT, pvs(a=0, b=0, c=100, d=100, e=9, f=9))
    assert plan["action"] == "refuse" and plan["argv"] == []
    assert "has 2 stripe(s) of 64 KiB and the pillar asks for 4 of 64 KiB" in plan["reason"]


def test_an_absolute_size_grows_to_that_size_in_whole_stripes():
    built = [segment(2, 200, ["/dev/a", "/dev/b"])]  # 800 MiB
    plan = lvm.extension("vg/lv", 2, 65536, "1000M", built, pvs(a=50, b=50))
    assert plan["argv"][0][2] == "+50" and plan["adds_bytes"] == 50 * MIB4  # 1000 MiB, 2 x 25
    assert lvm.extension("vg/lv", 2, 65536, "800M", built, pvs(a=50, b=50))["action"] == "none"
    short = lvm.extension("vg/lv", 2, 65536, "2G", built, pvs(a=50, b=50))
    assert short["action"] == "refuse" and "add devices in multiples of 2" in short["reason"]


@pytest.mark.parametrize("size", ["90%VG", "50%FREE", "100%PVS"])
def test_relative_sizes_other_than_100_free_do_not_grow(size):
    assert lvm.extension("vg/lv", 2, 65536, size, BUILT, pvs(c=100, d=100))["action"] == "none"


def test_a_single_stripe_lv_grows_linear():
    plan = lvm.extension("vg/lv", 1, 0, "100%FREE", [segment(1, 100, ["/dev/a"])], pvs(a=0, b=100))
    assert plan["argv"] == [["lvextend", "--extents", "+100", "vg/lv", "/dev/b"]]


@pytest.mark.parametrize(
    "text", ['{"report": [{"pv": [{"pv_name": "/dev/a"}]}]}', "[]", '{"report": [{"pv": [{"pv_name": "/dev/a", '
     '"vg_name": "v", "pv_pe_count": "1", "pv_pe_alloc_count": "2", "vg_extent_size": "4194304"}]}]}']
)  # fmt: skip
def test_a_malformed_pv_report_is_its_own_error(text):
    with pytest.raises(lvm.LvmReportError):
        lvm.parse_pv_room(text)


# ---- the pillar: an LV grows only in its own stripes -----------------------------------------------


def config(devices, stripes=None):
    volume = {"mountpoint": "/hana/log", "devices": [f"/dev/mapper/mpath{c}" for c in "abcdefgh"[:devices]]}
    if stripes:
        volume["stripes"] = stripes
    return {"volumes": {"log": volume}, "volume_defaults": {"stripe_size": 64}}


LOG_LV = "/dev/vg_hana_log/lv_hana_log"


def test_new_devices_without_stripes_are_refused_naming_the_counts():
    errors = pillar._growth_errors(config(7), {LOG_LV: {"stripes": 4, "stripe_size": 65536, "pvs": 4}})
    assert errors == [
        "hana:storage:volumes:log:stripes: /dev/vg_hana_log/lv_hana_log has 4 stripe(s) over 4 devices; 3 new "
        "device(s) in 7 stripes would add a 7-stripe segment: set stripes: 4 and give it a multiple of 4 "
        "devices (4, 8)"
    ]


def test_new_devices_in_the_lvs_own_stripes_pass():
    assert pillar._growth_errors(config(8, 4), {LOG_LV: {"stripes": 4, "stripe_size": 65536, "pvs": 4}}) == []
    # an LV made by hand in another geometry, no growth asked: the audit's business (LAYOUT-001)
    assert pillar._growth_errors(config(4), {LOG_LV: {"stripes": 2, "stripe_size": 65536, "pvs": 4}}) == []
    assert pillar._growth_errors(config(4), {}) == []


def test_the_xfs_geometry_ioctls_answer_is_parsed_and_bad_answers_are_errors():
    import struct

    from hana_storage_core import xfs

    raw = bytearray(xfs.GEOMETRY_SIZE)
    struct.pack_into("=I", raw, 0, 4096)
    struct.pack_into("=Q", raw, 32, 204800)
    assert xfs.parse_geometry(raw) == {"blocksize": 4096, "data_bytes": 838860800}
    for bad in (bytes(8), bytes(xfs.GEOMETRY_SIZE)):
        with pytest.raises(xfs.XfsError):
            xfs.parse_geometry(bad)
