# ruff: noqa: F811 - the host module fixture imported from tests/unit/test_module_facts.py is a parameter here
"""Attack 24: the `lvs` in_place_facts now runs on every LV, LUKS2 ones too (0ead962), and the
wrapper's lvchange that drops the copy's tags from an LV found LUKS2. The host module's own
in_place_facts, its reads of the host (blkid, the header, sysfs, the mount table) given; the
state through Salt's loader dunders. LVM's behaviour is scripted from its documentation: with
devices/ignore_suspended_devices = 0 (the default) a scan "waits for a suspended device to become
accessible" (lvm.conf); the formula's own reports pass lvm.NO_SUSPENDED for that reason."""

from unittest.mock import MagicMock

import pytest
from hana_storage_core import inplace

from tests.unit.test_inplace import LUKS, PVS, SEGMENTS, states
from tests.unit.test_module_facts import module  # noqa: F401 - the host module, loaded afresh

MIB = 1 << 20
LV = "/dev/vg_hana_data/lv_hana_data"
ENCRYPT = {"in_progress": True, "mode": "encrypt"}
OK = {"retcode": 0, "stdout": "", "stderr": ""}


class Hang(BaseException):
    """An LVM command that scans a suspended device: it waits until the device is resumed,
    which, for the stack a killed cryptsetup left, is never (the state run hangs)."""


def waits_for_suspended(argv):
    return argv[0] in ("lvs", "lvchange", "pvs", "vgs") and "ignore_suspended_devices = 1" not in " ".join(
        argv
    )


class Host:
    """An LV holding a LUKS2 header under an encryption in place, as the host module reads it."""

    def __init__(self, module, monkeypatch, tags, suspended=False, running=False, lvs_error=None):
        self.tags, self.ran, self.lvs_error = list(tags), [], lvs_error
        self.suspended = suspended
        header = {"version": 2, "uuid": "u-1", "reencryption": ENCRYPT}
        monkeypatch.setattr(module, "_blkid", lambda path: ([{"type": "crypto_LUKS"}], None))
        monkeypatch.setattr(module, "luks_header", lambda device: dict(header))
        stack = {
            "dm-3": {"dm": {"name": "hana_data", "suspended": suspended}},
            "dm-4": {"dm": {"name": "hana_data-hotzone-forward", "suspended": suspended}},
            "dm-5": {"dm": {"name": "hana_data-overlay", "suspended": False}},
        }
        monkeypatch.setattr(module, "_sysfs", lambda: {} if running else stack)
        monkeypatch.setattr(module, "_reencryption_runs", lambda crypt, device: running)
        monkeypatch.setattr(module, "_unit_output", lambda unit: "")
        monkeypatch.setattr(module, "mounted_at", lambda mountpoint: None)
        monkeypatch.setattr(module, "block_bytes", lambda path: 544 * MIB)
        monkeypatch.setattr(module, "_run", self.host_run)
        self.module = module

    def host_run(self, argv):
        self.ran.append(list(argv))
        if self.suspended and waits_for_suspended(argv):
            raise Hang(" ".join(argv))
        if argv[0] == "lvs":
            return (None, self.lvs_error) if self.lvs_error else (",".join(self.tags), None)
        return "", None

    def run_all(self, argv, **_):
        self.ran.append(list(argv))
        if self.suspended and waits_for_suspended(argv):
            raise Hang(" ".join(argv))
        if argv[0] == "lvchange":
            for at, word in enumerate(argv):
                if word == "--deltag" and argv[at + 1] in self.tags:
                    self.tags.remove(argv[at + 1])
        return OK

    def apply(self, monkeypatch, test=False):
        salt = {
            "hana_storage_host.in_place_facts": self.module.in_place_facts,
            "hana_storage_host.lv_room": MagicMock(return_value={"segments": SEGMENTS, "pvs": PVS}),
            "cmd.run_all": self.run_all,
        }
        monkeypatch.setattr(states, "__salt__", salt, raising=False)
        monkeypatch.setattr(states, "__opts__", {"test": test}, raising=False)
        monkeypatch.setattr(states, "__context__", {}, raising=False)
        monkeypatch.setattr(states, "_ramfs", lambda directory: None)  # the init's scratch: not here
        return states.encrypted_in_place("hana_data", LV, "/hana/data", "/k", LUKS, 2, 64, ["noatime"])


STALE = [inplace.plain_tag(512 * MIB), inplace.HEAD_COPY_BEGUN_TAG, inplace.HEAD_COPIED_TAG]


def test_a_frozen_stack_hangs_the_state_in_the_lvs_that_now_reads_every_lvs_tags(module, monkeypatch):
    """HOLE (fixed; the state run hangs for good, where it used to say "reboot the host": cryptsetup was
    SIGKILLed mid-hotzone and left hana_data and its hotzone device suspended - the stage
    "frozen", whose own refusal says "I/O to it hangs". Before 0ead962 in_place_facts read no
    LVM report for an LV whose LUKS2 header has a re-encryption under way; now it runs
    `lvs --noheadings -o lv_tags LV` on every LV, without lvm.NO_SUSPENDED (devices {
    ignore_suspended_devices = 1 }) that every other LVM report of the module passes. An lvs
    scans every block device its filter lets through, the suspended crypt mapping too, and with
    the default ignore_suspended_devices = 0 it waits for it to be resumed: the highstate blocks
    in the facts, the salt job never returns, and the refusal telling the admin to reboot is
    never written. (The wrapper's lvchange, had the facts returned, scans the same way.) Fix:
    pass lvm.NO_SUSPENDED to this lvs and to the state's lvchange commands, or read no LVM
    report when the facts show a suspended device of the stack."""
    host = Host(module, monkeypatch, STALE, suspended=True)
    try:
        ret = host.apply(monkeypatch)
    except Hang as hang:
        pytest.fail(f"the state run hangs in `{hang}` on a suspended stack (stage frozen)")
    assert ret["result"] is False and "Reboot the host" in ret["comment"], ret["comment"]


@pytest.mark.parametrize("running", [True, False], ids=["running", "closed"])
def test_an_lvs_failing_on_an_lv_under_encryption_now_fails_the_state_and_every_requisite(
    module, monkeypatch, running
):
    """HOLE (fixed; a volume that is being encrypted, or whose encryption only wants starting, turns red
    and takes its volume's whole chain with it: 0ead962 made in_place_facts run `lvs` on every
    LV and raise when it fails, only to learn whether stale copy tags are to be dropped. An lvs
    that fails - lvmlockd's lock not granted in time, a VG with a PV missing refused by a
    `lvs LV` of it, a metadata area unreadable for a moment - now ends the state as "cannot tell
    where the encryption of LV stands", result False, where before the LUKS2 header alone
    decided (running: the progress; closed: open it and start the unit again). luks.sls has
    luks-N require in-place: its open, crypttab and the mount are skipped as "requisite
    failed", and a closed encryption is not resumed. Fix: on a LUKS2 LV the tags are optional:
    an lvs error leaves the drop for a later run (say so in the comment), it does not raise."""
    host = Host(
        module, monkeypatch, STALE, running=running, lvs_error="lvs exited 5: lvmlockd: lock timed out"
    )
    ret = host.apply(monkeypatch)
    assert ret["result"] is not False, ret["comment"]


def test_test_mode_on_a_luks_lv_with_stale_copy_tags_says_so_and_moves_no_tag(module, monkeypatch):
    """CLOSED. test=True on an LV being encrypted (the unit runs) with both copy tags: the
    result is None, the comment names the tags it would drop, and nothing but reads ran (one
    lvs, no lvchange)."""
    host = Host(module, monkeypatch, STALE, running=True)
    ret = host.apply(monkeypatch, test=True)
    assert ret["result"] is None and "Would drop the LVM tags" in ret["comment"], ret
    assert ret["changes"] == {} and host.tags == STALE
    assert [argv[0] for argv in host.ran] == ["lvs"], host.ran


def test_a_failing_lvchange_in_the_wrappers_drop_is_said_and_raises_nothing(module, monkeypatch):
    """CLOSED. The drop's lvchange failing on a running encryption: no exception, the tags
    named in the comment as staying, the progress still reported."""
    host = Host(module, monkeypatch, STALE, running=True)

    def refuse(argv, **_):
        host.ran.append(list(argv))
        if argv[0] == "lvchange":
            return {"retcode": 5, "stdout": "", "stderr": "Cannot update volume group: VG is partial"}
        return OK

    host.run_all = refuse
    ret = host.apply(monkeypatch)
    assert ret["comment"].startswith("encrypting hana_data"), ret["comment"]
    assert "stay:" in ret["comment"] and "VG is partial" in ret["comment"], ret["comment"]
    assert host.tags == STALE and "copy_tags_dropped" not in ret["changes"]
