"""A path a boot gave to another disk, in the two moments the ledger's path checks cannot tell:
the spare found blank but not yet formatted, and a freed device whose old PV label the runner
wiped before its luksFormat was cut short. Both disks carry no signature then, so only what
names the disk itself (move_runner.identity: its WWID or serial and its size) tells the disk the
moves vouched for from another blank-looking one."""

import json

import pytest
from hana_storage_core import move_runner, moves

from tests.unit.test_attack25_moves import _luks_policy, states
from tests.unit.test_attack26_moves import RunnerHost
from tests.unit.test_moves import DEVICES, SPARE, blank_ledger, the_plan, volume_plan

OTHER_DISK = "serial-sbd/2050048"  # an SBD LUN, or a LUN used raw: no signature blkid knows


def steps_to(host, ledger, action, move):
    """Run the steps up to the first ``action`` of ``move`` (not performed); that step."""
    for _ in range(100):
        step = moves.next_step(host.plan, host.facts(), ledger)
        if step["action"] == action and step["move"] == move:
            return step
        host.perform(step, ledger)
    raise AssertionError(f"no {action} of move {move}")


def test_the_spare_renumbered_before_its_format_is_refused_not_formatted():
    host, ledger = RunnerHost(the_plan()), blank_ledger()
    assert steps_to(host, ledger, "format", 0)["target"]["device"] == SPARE
    host.identities[SPARE] = OTHER_DISK
    step = moves.next_step(host.plan, host.facts(), ledger)
    assert step["action"] == "refuse", step
    assert f"{SPARE} is {OTHER_DISK}" in step["text"] and "found it blank" in step["text"], step["text"]


def test_a_freed_device_renumbered_between_its_wipefs_and_its_luksformat_is_refused():
    host, ledger = RunnerHost(the_plan()), blank_ledger()
    step = steps_to(host, ledger, "format", 1)
    freed = step["target"]["device"]
    assert freed == DEVICES[0] and ledger["identity"][freed] == host.identities[freed]
    ledger["wiping"] = freed  # the runner's mark, then wipefs -a: the LVM label gone, then a kill
    host.signatures[freed] = []
    host.pvs.pop(freed)
    assert moves.next_step(host.plan, host.facts(), ledger)["action"] == "format"  # the same disk: on
    host.identities[freed] = OTHER_DISK  # a boot: another disk without a signature at the path
    step = moves.next_step(host.plan, host.facts(), ledger)
    assert step["action"] == "refuse" and "freed it" in step["text"], step


def test_a_ledger_without_identities_still_reads_and_its_moves_run_to_the_end():
    """A ledger a runner wrote before identities were kept: the path checks alone, as then."""
    host, ledger = RunnerHost(the_plan()), {**blank_ledger(), "identity": {}}
    del ledger["identity"]
    ledger = moves.check_ledger(ledger)
    for _ in range(200):
        step = moves.next_step(host.plan, host.facts(), ledger)
        if step["action"] in ("done", "refuse"):
            break
        host.perform(step, ledger)
    assert step["action"] == "done", step


@pytest.mark.parametrize("identity", [[], {"/dev/vde": 7}, {"/dev/vde": None}, "serial"])
def test_a_ledger_whose_identities_are_not_what_the_runner_writes_is_refused(identity):
    with pytest.raises(moves.MovesError, match="not what the runner writes"):
        moves.check_ledger({**blank_ledger(), "identity": identity})


def sysfs_entry(root, name, files):
    entry = root / name
    for relative, text in files.items():
        (entry / relative).parent.mkdir(parents=True, exist_ok=True)
        (entry / relative).write_text(text + "\n")
    return entry


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"size": "2050048", "device/wwid": "naa.600a0980383034"}, "naa.600a0980383034/2050048"),
        ({"size": "2050048", "serial": "vol0abc"}, "vol0abc/2050048"),  # NVMe, virtio
        ({"size": "2050048", "dm/uuid": "mpath-3600a098038"}, "mpath-3600a098038/2050048"),
        ({"size": "2050048"}, "/2050048"),  # no ID of its own: its size only
    ],
)
def test_the_identity_is_the_disks_id_and_size(tmp_path, files, expected):
    assert move_runner.sysfs_identity(str(sysfs_entry(tmp_path, "disk", files))) == expected


def test_a_partitions_identity_is_its_disks_id_its_number_and_its_size(tmp_path):
    disk = sysfs_entry(tmp_path, "sdb", {"size": "4096000", "device/wwid": "naa.6001"})
    part = sysfs_entry(disk, "sdb2", {"size": "1024000", "partition": "2"})
    assert move_runner.sysfs_identity(str(part)) == "naa.6001-part2/1024000"


def test_nothing_at_a_path_has_no_identity(tmp_path):
    assert move_runner.identity(str(tmp_path / "gone")) is None
    assert move_runner.identity("/dev/null") is None  # a character device


def test_the_state_records_the_identity_of_the_spare_it_found_blank(monkeypatch, tmp_path):
    monkeypatch.setattr(moves, "MOVES_DIR", str(tmp_path))
    monkeypatch.setattr(states, "_moves_refused", lambda volume, plan, facts: None)  # the spare blank
    host = RunnerHost(the_plan())
    found = {"ledger": None, "facts": host.facts(), "unit": "u", "running": False}
    monkeypatch.setattr(
        states,
        "__salt__",
        {
            "hana_storage_host.moves_stored_plan": lambda name: None,
            "hana_storage_host.moves_facts": lambda plan: {
                **found,
                "step": moves.next_step(plan, found["facts"], moves.new_ledger()),
            },
            "hana_storage_host.dm_uuid": lambda device: "",
            "hana_storage_host.xfs_superblock": lambda device: {"sectsize": 4096},
            "hana_storage_host.unit_active": lambda unit: True,
            "cmd.run_all": lambda *a, **k: {"retcode": 0, "stdout": "", "stderr": ""},
        },
        raising=False,
    )
    monkeypatch.setattr(states, "__opts__", {"test": False}, raising=False)
    ret = states.moved_onto_luks("data", volume_plan(), _luks_policy())
    assert ret["result"] is True, ret
    ledger = json.loads((tmp_path / "data.ledger.json").read_text())
    assert ledger["spare_device"] == SPARE and ledger["identity"] == {SPARE: host.identities[SPARE]}
