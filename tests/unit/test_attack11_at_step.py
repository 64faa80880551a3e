"""A second review of the kept LVM reports (after test_attack10): a step that re-reads what
it is about to act on still reads a report that leaves out a device suspended at that moment.
vg_extended took such a PV of its own VG for a new one (LVM then refuses the whole vgextend:
the new PV is not added and the healthy volume's later steps are skipped); below LVM, pv_safe
named a PV LVM did not list "a PV of volume group None". Both tests failed on 77f2a69."""

# ruff: noqa: F811 - the fixtures imported from test_states are parameters

import pytest
from hana_storage_core import safety

from tests.unit.test_attack9_pv_reads import MPATH, host  # noqa: F401  (host: a fixture)
from tests.unit.test_attack10_run_reports import BlkidLvm, block_devices, on_lvm_host
from tests.unit.test_states import (  # noqa: F401  (fixtures: pytest finds them by name here)
    configure_loader_modules,
    dry_run,
    fake_paths,
    marks,
    opts,
    pillar_data,
    salt_functions,
    scratch,
    states,
    tabs,
)


def vgextends(lvm_host):
    return [argv for argv in lvm_host.ran if argv[0] == "vgextend"]


class VgextendLvm(BlkidLvm):
    """vgextend answers as LVM 2.03 does for a PV already in a VG (toollib.c _check_pvcreate_prompt):
    "Physical volume '<pv>' is already in volume group '<vg>'", and the whole command fails."""

    def run_all(self, argv, **kwargs):
        if argv[0] == "vgextend":
            self.ran.append(list(argv))
            taken = [pv for pv in argv[2:] if self.owner.get(pv)]
            if taken:
                return {
                    "retcode": 5,
                    "stdout": "",
                    "stderr": (
                        f"Physical volume '{taken[0]}' is already in volume group '{self.owner[taken[0]]}'\n"
                        f"  Unable to add physical volume '{taken[0]}' to volume group '{self.owner[taken[0]]}'"
                    ),
                }
            for pv in argv[2:]:
                self.owner[pv] = argv[1]
            return {"retcode": 0, "stdout": "", "stderr": ""}
        return super().run_all(argv, **kwargs)


@pytest.mark.parametrize("test", [True, False], ids=["test", "apply"])
def test_vg_extended_does_not_add_a_pv_of_its_vg_suspended_at_its_step(
    salt_functions, host, monkeypatch, opts, test
):
    """A growth apply: vg_hana_data is mpatha+mpathb, the pillar adds mpathc. pv-0 and pv-1 find
    their PVs in the run's pvs; pv-2 pvcreates mpathc (the run's reports are dropped). Then
    multipathd reloads mpathb: vg_present's fresh pvs and vg_extended's _afresh (two reads ms
    apart) both leave it out. pv_present guards exactly this with dm_suspended ("run again");
    vg_extended does not: it takes mpathb for a new PV and says it would add it (test), or runs
    `vgextend vg_hana_data mpathb mpathc`, which LVM refuses as a whole: mpathc is not added and
    every later step of the healthy volume is skipped."""
    opts["test"] = test
    owner = {**dict.fromkeys(MPATH[:2], "vg_hana_data")}
    lvm_host = VgextendLvm(owner)
    on_lvm_host(salt_functions, host, monkeypatch, lvm_host)
    for pv in MPATH[:3]:
        assert states.pv_present(pv)["result"] in (True, None)
    lvm_host.suspended = {MPATH[1]}  # the reload starts
    if not test:  # what pv_present says now, on a report it reads (under test the run's still lists it)
        assert "suspended" in states.pv_present(MPATH[1])["comment"]
    assert states.vg_present("vg_hana_data", MPATH[:3])["result"] is True
    ret = states.vg_extended("vg_hana_data", MPATH[:3])
    assert not vgextends(lvm_host), (ret, vgextends(lvm_host))
    assert ret["result"] is False and "would run" not in ret["comment"], ret
    assert f"{MPATH[1]} is suspended" in ret["comment"] and ret["comment"].endswith("run again"), ret


def test_pv_safe_names_no_volume_group_none(salt_functions, host, monkeypatch):
    """Below LVM, pv_safe probes the opened LUKS device; its PV is not in pvs (suspended while LVM
    read, or pvs failed). The "pv" layer still says "is a PV of volume group None" with code
    foreign_signature: the operator is sent looking for a VG named None. The guard got its own
    code for this (pv_vg_unknown); the layer verdict did not."""
    crypt = "/dev/mapper/hana_log_0"
    lvm_host = BlkidLvm({crypt: "vg_hana_log"})
    on_lvm_host(salt_functions, host, monkeypatch, lvm_host)
    block_devices(host, monkeypatch, [crypt])
    fake_paths(monkeypatch, present=[crypt])
    salt_functions["hana_storage_host.probe"] = host.probe
    lvm_host.suspended = {crypt}
    ret = states.pv_safe(crypt, "vg_hana_log", lv_dm_name="vg_hana_log-lv_hana_log")
    verdict = safety.layer_verdict(
        "pv",
        {"device": crypt, "signatures": [{"type": "LVM2_member"}], "pv_vg": None},
        False,
        own_vg="vg_hana_log",
    )
    assert ret["result"] is False  # refused: safe
    assert "None" not in ret["comment"] and verdict["code"] != "foreign_signature", (ret["comment"], verdict)


def test_lv_extended_under_test_promises_no_room_on_a_pv_suspended_at_its_step(
    salt_functions, host, monkeypatch, dry_run
):
    """test=True, nothing to do: vg_hana_data (mpatha, mpathb) has no free extent. mpathb, a PV
    of the VG, is suspended while lv_extended reads (the kept report and its fresh one): the
    estimate for PVs that would join the VG took it for a new one and promised its room."""
    segment = {"vg": "vg_hana_data", "lv": "lv_hana_data", "devices": MPATH[:1]}
    lvm_host = BlkidLvm(dict.fromkeys(MPATH[:2], "vg_hana_data"), [segment])
    on_lvm_host(salt_functions, host, monkeypatch, lvm_host)
    salt_functions["hana_storage_host.block_bytes"].return_value = 1 << 30
    lvm_host.suspended = {MPATH[1]}
    ret = states.lv_extended("/dev/vg_hana_data/lv_hana_data", 1, 64, "100%FREE", MPATH[:2])
    assert "would grow" not in ret["comment"] and "joined" not in ret["comment"], ret
    assert f"{MPATH[1]} is suspended" in ret["comment"], ret
