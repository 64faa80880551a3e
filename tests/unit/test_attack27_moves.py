"""Attack 27: the identities in the moves' ledger (627bd17). Each test asserts the safe
behaviour; each failed on 627bd17: a freed device of a ledger written before identities were
kept, formatted after a renumbering boot; a LUN grown in place taken for another disk; a
multipath map and its path device named apart; md arrays of one size alike; an unreadable
WWID file read as "no ID"; a character device given a block device's identity."""

import os
import stat
import types

from hana_storage_core import move_runner, moves

from tests.unit.test_attack26_moves import RunnerHost
from tests.unit.test_moves import blank_ledger, the_plan
from tests.unit.test_moves_identity import OTHER_DISK, steps_to, sysfs_entry


# H1: a run resumed after the formula upgrade, its D0 released by the old runner:
# the format step re-verifies D0's PV label but records no identity with its wiping mark, so
# a boot between wipefs and luksFormat lets another blank disk be formatted.
def test_H1_old_ledger_freed_device_gets_identity_backfilled_before_wipefs():
    host, ledger = RunnerHost(the_plan()), blank_ledger()
    step = steps_to(host, ledger, "format", 1)  # D0 released, about to be wiped and formatted
    freed = step["target"]["device"]
    ledger["identity"].pop(freed)  # as the old runner's release left it
    host.perform(step, ledger)  # wiping mark, wipefs, luksFormat ... cut by a kill after wipefs:
    ledger["formatted"].remove(freed)
    ledger["wiping"] = freed
    host.luks.pop(freed, None)
    host.pvs.pop(freed, None)
    host.signatures[freed] = []
    host.identities[freed] = OTHER_DISK  # a boot renumbered the path
    step = moves.next_step(host.plan, host.facts(), ledger)
    assert step["action"] == "refuse", f"wipefs+luksFormat on another disk: {step['text']}"


# H2: the same LUN (same WWID), grown on the array between its release and its
# format (a kill/boot/failed luksFormat in between): refused forever as "another disk".
def test_H2_same_wwid_grown_lun_is_the_same_disk():
    host, ledger = RunnerHost(the_plan()), blank_ledger()
    step = steps_to(host, ledger, "format", 1)
    freed = step["target"]["device"]
    wwid, _, size = host.identities[freed].partition("/")
    host.identities[freed] = f"{wwid}/{int(size) * 2}"
    step = moves.next_step(host.plan, host.facts(), ledger)
    assert step["action"] == "format", step["text"]


# H3: a multipath map and its path device name one LUN but two identities; a by-id link
# (scsi-3.../wwn-0x...) points at the map or at a path depending on whether multipathd claimed it.
def test_H3_multipath_map_and_its_path_have_one_identity(tmp_path):
    path = sysfs_entry(tmp_path, "sdc", {"size": "2050048", "device/wwid": "naa.600a098038303034"})
    mpath = sysfs_entry(tmp_path, "dm-3", {"size": "2050048", "dm/uuid": "mpath-3600a098038303034"})
    (mpath / "slaves").mkdir()
    os.symlink(path, mpath / "slaves" / "sdc")
    assert move_runner.sysfs_identity(str(mpath)) == move_runner.sysfs_identity(str(path))


# H4: md arrays' own UUID is not read: two md arrays of one size are one identity.
def test_H4_md_arrays_are_told_apart(tmp_path):
    a = sysfs_entry(tmp_path, "md0", {"size": "2050048", "md/uuid": "1111:2222:3333:4444"})
    b = sysfs_entry(tmp_path, "md1", {"size": "2050048", "md/uuid": "5555:6666:7777:8888"})
    assert move_runner.sysfs_identity(str(a)) != move_runner.sysfs_identity(str(b))


# H5: an unreadable WWID file (EIO, EACCES) silently degrades to size only: recorded at
# release, any same-size blank disk then passes.
def test_H5_unreadable_wwid_is_not_silently_size_only(tmp_path):
    disk = sysfs_entry(tmp_path, "sdc", {"size": "2050048"})
    (disk / "device").mkdir()
    (disk / "device" / "wwid").mkdir()  # open() fails with IsADirectoryError, an OSError like EIO
    try:
        got = move_runner.sysfs_identity(str(disk))
    except (OSError, move_runner.StepFailed, moves.MovesError):
        return  # a clear failure: fine
    assert got != "/2050048", "a WWID file that cannot be read taken for a disk without an ID"


# H6: identity() takes a character device's numbers as a block device's: /dev/null (c 1:3)
# reads /sys/dev/block/1:3, which is /dev/ram3 when brd is loaded.
def test_H6_a_character_device_has_no_identity(monkeypatch, tmp_path):
    ram3 = sysfs_entry(tmp_path, "ram3", {"size": "2050048"})
    fake_stat = types.SimpleNamespace(st_rdev=os.makedev(1, 3), st_mode=stat.S_IFCHR | 0o666)
    fake_os = types.SimpleNamespace(
        stat=lambda p: fake_stat,
        major=os.major,
        minor=os.minor,
        path=types.SimpleNamespace(
            isdir=lambda p: p == "/sys/dev/block/1:3" or os.path.isdir(p),
            realpath=lambda p: str(ram3) if p == "/sys/dev/block/1:3" else os.path.realpath(p),
            exists=os.path.exists,
            dirname=os.path.dirname,
        ),
    )
    monkeypatch.setattr(move_runner, "os", fake_os)
    assert move_runner.identity("/dev/null") is None
