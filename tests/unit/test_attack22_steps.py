# ruff: noqa: F811 - pytest fixtures imported from tests/unit/test_inplace.py are parameters here
"""Attack 22: the new steps in the unmounted window (copy-begun, copy, verify, copied), their
failures, and the facts they trust. The state through Salt's loader dunders, the host's facts
given (pure logic)."""

from unittest.mock import MagicMock

import pytest
from hana_storage_core import inplace

from tests.unit.test_inplace import (  # noqa: F401 - fixtures
    HOST_FACTS,
    LUKS,
    configure_loader_modules,
    host,
    opts,
    scratch,
    states,
)

MIB = 1 << 20
LV = "/dev/vg_hana_data/lv_hana_data"
GROWN = dict(HOST_FACTS, lv_tags=[inplace.plain_tag(512 * MIB)], device_bytes=544 * MIB, tail="zero")


def apply():
    return states.encrypted_in_place("hana_data", LV, "/hana/data", "/k", LUKS, 2, 64, ["noatime"])


def ran(host):
    return [c.args[0] for c in host["cmd.run_all"].call_args_list]


def test_an_lvchange_that_fails_after_the_umount_leaves_hana_unmounted(host):
    """HOLE (fixed; HANA's filesystem stays unmounted though nothing was written: the LV's tag from an
    earlier run is there, so no lvchange runs before the umount; the VG then refuses metadata
    writes - a PV of the VG missing (LVM keeps the LV active but refuses lvchange on a partial
    VG), lvmlockd, a full metadata area - and the copy-begun lvchange fails after the umount; the
    mount-back first tries another lvchange (--deltag both), which fails the same way, and then
    refuses to mount: "stays unmounted"; the LV holds no COPIED tag, so nothing made the mount
    unsafe). Fix: set the BEGUN tag before the umount (it is true while mounted: cryptsetup has
    not run), so a VG that refuses tags fails the state with HANA still mounted; and on the
    mount-back, mount whenever the LV holds no COPIED tag (re-read lvs), whatever the untag did."""
    host["hana_storage_host.in_place_facts"].return_value = dict(GROWN)
    host["cmd.run_all"].side_effect = lambda argv, **kw: (
        {"retcode": 5, "stdout": "", "stderr": "Cannot change VG vg_hana_data while PVs are missing."}
        if argv[0] == "lvchange"
        else {"retcode": 0, "stdout": "", "stderr": ""}
    )
    ret = apply()
    assert ret["result"] is False
    programs = [a[0] for a in ran(host)]
    # fixed: the begun tag is set before the umount, so the VG's refusal leaves HANA mounted
    assert "umount" not in programs or "mount" in programs[programs.index("umount") :], (
        programs,
        ret["comment"],
    )


def test_a_cryptsetup_reencrypt_running_on_the_still_xfs_lv_is_not_raced(host):
    """HOLE (fixed; data loss: a `cryptsetup reencrypt --encrypt --init-only` of the LV runs - started by
    hand, e.g. by an admin following the old torn advice - and the LV still reads XFS because
    its header write has not landed yet; the facts say running=True, but stage() looks at
    "running" only for a LUKS signature: "plain". The state then copies the head over the tail
    with dd while that cryptsetup is between its own copy and its header write (the tail is then
    the only copy of the head), and runs a second init on top). Fix: in inplace.stage, refuse (or
    report "running") whenever facts["running"] is true, before the signature decides anything."""
    host["hana_storage_host.in_place_facts"].return_value = dict(GROWN, mounted_from=None, running=True)
    ret = apply()
    assert not [a for a in ran(host) if a[0] in ("dd", "cryptsetup", "lvchange")], (ran(host), ret)
    assert inplace.stage(dict(GROWN, running=True))[0] != "plain"


def test_test_mode_plans_the_copy_and_runs_nothing(host, opts):
    """CLOSED. test=True: the copy's steps are in the plan; no command runs, no tag moves, and the
    copy's callables are never called (no block_bytes, no tail read)."""
    opts["test"] = True
    host["hana_storage_host.in_place_facts"].return_value = dict(GROWN)
    ret = apply()
    assert ret["result"] is None and "copy its first 16 MiB" in ret["comment"], ret["comment"]
    assert ran(host) == []
    assert not host["hana_storage_host.block_bytes"].called
    assert not host["hana_storage_host.tail_state"].called


@pytest.mark.parametrize(
    "given,stage",
    [
        # the state's copy cut at any point before COPIED: the head is intact, go on
        ({"head_copy": "begun", "tail": "other"}, "plain"),
        ({"head_copy": "begun", "tail": "copy"}, "plain"),
        # an earlier version's init whose own copy completed and whose header never started
        ({"head_copy": None, "tail": "copy"}, "plain"),
        # a mapping of the same name beside an unencrypted XFS: never touched
        ({"head_copy": "copied", "tail": "copy", "mapped": True}, "foreign"),
        ({"head_copy": None, "tail": "other", "mapped": True}, "foreign"),
        # no XFS and no header: only a complete copy's tag makes it "torn"
        ({"signature": "", "head_copy": "begun", "tail": "other"}, "foreign"),
        ({"signature": "", "head_copy": "copied", "tail": "other"}, "torn"),
    ],
)
def test_the_copy_tags_and_the_tail_decide_the_stage(given, stage):
    """CLOSED. The stages of a grown LV with no header, by its copy tags and tail."""
    assert inplace.stage(dict(GROWN, **given))[0] == stage


def test_a_verify_that_reads_back_other_stops_before_cryptsetup(host):
    """CLOSED. A copy that reads back unequal never reaches cryptsetup; the XFS is mounted back."""
    host["hana_storage_host.in_place_facts"].return_value = dict(GROWN)
    host["hana_storage_host.tail_state"] = MagicMock(return_value="other")
    ret = apply()
    programs = [a[0] for a in ran(host)]
    assert ret["result"] is False and "cryptsetup" not in programs, programs
    assert programs[-1] == "mount" and "mounted back" in ret["comment"], ret["comment"]
