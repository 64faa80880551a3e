# ruff: noqa: F811 - pytest fixtures imported from tests/unit/test_inplace.py are parameters here
"""Attack 17: the steps of hana_storage.encrypted_in_place, their order, and what a failed or
refused step leaves. Fixtures from tests/unit/test_inplace.py (the state through Salt's loader
dunders, the host's facts given)."""

import pytest
from hana_storage_core import inplace
from salt.exceptions import CommandExecutionError

from tests.unit.test_inplace import (  # noqa: F401 - fixtures
    ENCRYPT,
    HOST_FACTS,
    LV,
    PVS,
    SEGMENTS,
    apply,
    commands,
    configure_loader_modules,
    host,
    opts,
    states,
)


@pytest.fixture
def scratch(monkeypatch, tmp_path):
    monkeypatch.setattr(states, "SCRATCH", str(tmp_path))
    monkeypatch.setattr(states, "_ramfs", lambda directory: None)


def _failing(program_prefix, message):
    def run_all(argv, **kwargs):
        bad = argv[: len(program_prefix)] == program_prefix
        return {"retcode": 1 if bad else 0, "stdout": "", "stderr": message if bad else ""}

    return run_all


@pytest.mark.parametrize(
    "prefix,message",
    [
        (["lvchange"], "Volume group vg_hana_data metadata is read-only"),
        (["lvextend"], "Insufficient suitable allocatable extents"),
        (
            ["cryptsetup", "reencrypt"],
            "Failed to open /dev/vg_hana_data/lv_hana_data in exclusive mode (already mapped or mounted).",
        ),
    ],
)
def test_a_step_that_fails_after_the_unmount_leaves_hana_without_its_filesystem(
    host, scratch, prefix, message
):
    """HOLE (outage). The state unmounts first, then tags and extends the LV, then runs the init;
    any of those failing returns with /hana/data unmounted ("Apply again to go on from here"), and
    every later state of the volume (luks, open, mkfs, mount) requires this one, so the run never
    mounts it again. A real cause that persists: a bind mount of the XFS elsewhere, or a mount
    namespace holding it (cryptsetup then refuses the device in exclusive mode: checked on a loop
    device) - each apply leaves HANA's volume unmounted again. The README says the LV is grown
    first and the unmount is "the only moment HANA must be down". Fix: tag and lvextend before the
    umount (lvextend is online); after a failed init whose device still reads as the plain XFS,
    mount it back from the LV before returning."""
    host["cmd.run_all"].side_effect = _failing(prefix, message)
    ret = apply()
    assert ret["result"] is False and message in ret["comment"]
    ran = [argv[0] for argv in commands(host)]
    if "umount" in ran:
        assert "mount" in ran[ran.index("umount") :], (
            f"{' -> '.join(ran)}: /hana/data stays unmounted after the failure ({ret['comment'][:120]})"
        )


def test_no_scratch_ramfs_after_the_unmount_leaves_hana_without_its_filesystem(host, monkeypatch):
    """HOLE (outage, and a mis-stated message). The init needs its private ramfs; when it cannot
    be mounted (a container, ramfs not allowed), the state has already unmounted /hana/data and
    returns "no private scratch directory for Clevis" - for a step that has nothing to do with
    Clevis. Fix: make the scratch directory before the umount (or remount on failure), and say
    what needs it."""

    def no_ramfs(directory):
        raise CommandExecutionError("mount: permission denied")

    monkeypatch.setattr(states, "_ramfs", no_ramfs)
    ret = apply()
    assert ret["result"] is False
    ran = [argv[0] for argv in commands(host)]
    assert "umount" not in ran or "mount" in ran[ran.index("umount") :], (
        f"{' -> '.join(ran)}: /hana/data stays unmounted ({ret['comment'][:160]})"
    )
    assert "Clevis" not in ret["comment"], ret["comment"]


@pytest.mark.parametrize("mounted_from", ["crypt", None])
def test_a_plain_volume_whose_crypt_name_is_taken_is_refused_before_anything_runs(
    host, scratch, mounted_from
):
    """HOLE (wrong action). The LV holds the plain XFS, but /dev/mapper/hana_data already exists
    (another device's mapping of that name, a leftover) and may be what is mounted at /hana/data.
    stage() says "plain" without looking at ``mapped``; the state then unmounts /hana/data (a
    filesystem that is not the LV's: mounted_from == "crypt") and tags and grows the LV, and only
    then does cryptsetup refuse ("Device hana_data already exists"). Fix: in stage "plain", a
    mapping of the crypt name, or a mount from it, is refused before any step, naming it."""
    host["hana_storage_host.in_place_facts"].return_value = dict(
        HOST_FACTS, mapped=True, mounted_from=mounted_from
    )
    ret = apply()
    assert ret["result"] is False, ret
    assert commands(host) == [], f"ran {[a[:2] for a in commands(host)]} before cryptsetup could refuse"


def test_an_encrypt_in_place_pillar_on_a_new_host_never_gets_its_volume(host, monkeypatch):
    """HOLE (wrong action, provisioning). A pillar with ``encrypt_in_place: true`` applied to a
    host whose LUNs are new (a reinstall, a new host of the same class): lv_present creates a
    blank LV in this run, the in-place state calls it "foreign" (no known signature) and fails,
    and luks-0, which requires it, never formats the LV - the volume is never made, though the
    formula would format a blank LV it created itself (luks_formatted's created_by). Fix: a blank
    LV is no volume to encrypt in place: return True ("nothing to encrypt: formatted as LUKS2 by
    the next step") and let luks_formatted's guard decide, or pass created_by to this state."""
    host["hana_storage_host.in_place_facts"].return_value = dict(
        HOST_FACTS, signature="", mounted_from=None, fs_bytes=None, fs_sector=None
    )
    monkeypatch.setattr(
        states,
        "__running__",
        {"lv": {"__id__": "hana-storage-data-lv", "result": True, "changes": {"created": {"lv": LV}}}},
        raising=False,
    )
    ret = apply()
    assert ret["result"] is not False, ret["comment"]
    assert commands(host) == []


# ---- closed: tried and found safe ------------------------------------------------------------


@pytest.mark.parametrize(
    "facts,lv_room,words",
    [
        # free room on one PV of two stripes: lvm.extension refuses before any step
        (
            {},
            {"segments": SEGMENTS, "pvs": [PVS[0], dict(PVS[1], free=0)]},
            "must grow by 33554432 bytes",
        ),
        ({"fs_bytes": None}, None, "is not known"),
        ({"device_bytes": None}, None, "is not known"),
        ({"lv_tags": ["hana_storage_plain_bytes_0x20000000"]}, None, "do not say one size"),
        ({"lv_tags": [f"hana_storage_plain_bytes_{1 << 50}"]}, None, "less than"),
        ({"fs_bytes": 600 << 20}, None, "larger than the volume"),
    ],
)
def test_closed_odd_sizes_tags_and_a_short_vg_are_refused_before_the_unmount(host, facts, lv_room, words):
    """CLOSED. Each is refused with nothing run (no umount): sizes unknown, a tag that is not
    one decimal size, a tag larger than the LV, an XFS larger than the LV, a VG whose room is on
    fewer PVs than the stripes."""
    host["hana_storage_host.in_place_facts"].return_value = dict(HOST_FACTS, **facts)
    if lv_room:
        host["hana_storage_host.lv_room"].return_value = lv_room
    ret = apply()
    assert ret["result"] is False and words in ret["comment"], ret["comment"]
    assert commands(host) == []


def test_closed_an_lv_killed_after_its_extension_is_not_grown_again(host, scratch):
    """CLOSED. Killed after lvextend: the tag says the size before, the LV already has the room;
    the next apply neither tags nor extends again, and the init takes the same room."""
    host["hana_storage_host.in_place_facts"].return_value = dict(
        HOST_FACTS, device_bytes=(512 << 20) + (32 << 20), lv_tags=[inplace.plain_tag(512 << 20)]
    )
    ret = apply()
    assert ret["result"] is True, ret
    ran = commands(host)
    # no extension and no size tag again: the only LVM changes are the head copy's own tags
    assert [a[0] for a in ran if a[0] == "lvextend"] == []
    assert not [a for a in ran if a[0] == "lvchange" and any(t.startswith(inplace.PLAIN_TAG) for t in a)]
    init = next(a for a in ran if a[:2] == ["cryptsetup", "reencrypt"])
    assert init[init.index("--reduce-device-size") + 1] == "32M"


def test_closed_a_header_under_another_mode_of_reencryption_is_refused(host):
    """CLOSED. A LUKS2 header under a re-encryption the formula did not start (decrypt,
    reencrypt) is refused, nothing run."""
    host["hana_storage_host.in_place_facts"].return_value = dict(
        HOST_FACTS,
        signature="crypto_LUKS",
        reencryption={"in_progress": True, "mode": "decrypt"},
        mapped=True,
        mounted_from="crypt",
    )
    ret = apply()
    assert ret["result"] is False and "Nothing was changed" in ret["comment"]
    assert commands(host) == []


def test_closed_encryption_under_way_mounted_from_another_device_is_left_alone(host):
    """CLOSED. The mountpoint mounted from a third device: refused, nothing run."""
    host["hana_storage_host.in_place_facts"].return_value = dict(
        HOST_FACTS, signature="crypto_LUKS", reencryption=ENCRYPT, mapped=True, mounted_from="other",
        leftovers=["hana_data-overlay"],
    )  # fmt: skip
    ret = apply()
    assert ret["result"] is False and commands(host) == []
