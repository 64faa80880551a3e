"""The encryption in place below LVM (moves.py): the pillar's gate, the chain of moves, and the
steps decided on a simulated host, run to the end from every point a kill can leave, with what
each step may touch checked on the way. The host's side (move_runner) runs in the VM tier."""

import copy

import pytest
import yaml
from hana_storage_core import moves, tab
from hana_storage_core import pillar as hp

from tests.conftest import REPO
from tests.unit.test_pillar import errors_of, mutate
from tests.unit.test_sls import rendered_all, requires

DEFAULTS = yaml.safe_load((REPO / "salt/hana/storage/parameters/defaults.yaml").read_text())
KEY = "/etc/hana-storage/keys/hana.key"
DEVICES = ["/dev/vdb", "/dev/vdc", "/dev/vdd"]
SPARE = "/dev/vde"
EXTENT = 4 << 20
LUN_EXTENTS = 250  # a raw PV's extents on a 1001 MiB LUN; a LUKS PV on it holds 4 fewer


def storage(**volume):
    return {
        "key": {"source": "keyfile", "path": KEY},
        "volumes": {
            "data": {
                "mountpoint": "/hana/data",
                "devices": DEVICES,
                "encryption": "below_lvm",
                "encrypt_in_place": True,
                "in_place_spare": SPARE,
                **volume,
            }
        },
    }


def volume_plan(**volume):
    return hp.normalize(hp.merge(DEFAULTS, storage(**volume)))["volumes"]["data"]


def the_plan():
    volume = volume_plan()
    names = [volume["spare"]["name"], *(c["name"] for c in volume["crypt"])]
    return moves.plan(
        volume,
        KEY,
        {"type": "luks2", "cipher": "aes-xts-plain64", "key_size": 512, "sector_size": 4096},
        ["--perf-no_read_workqueue"],
        {n: f"{n} UUID=u-{n} {KEY} luks" for n in names},
        {n: f"u-{n}" for n in names},
    )


class Host:
    """A host as read_facts sees it, changed by each step as the runner's commands would."""

    def __init__(self, plan, alloc=(200, 200, 200)):
        self.plan = plan
        self.vg = plan["vg"]
        self.pvs = {
            d: {"vg": self.vg, "pe_count": LUN_EXTENTS, "alloc": a, "extent": EXTENT, "uuid": f"pv-{d}"}
            for d, a in zip(DEVICES, alloc, strict=True)
        }
        self.luks, self.open, self.crypttab = {}, {}, []
        self.signatures = {d: ["LVM2_member"] for d in DEVICES}
        self.signatures[SPARE] = []
        self.moving = None
        self.formatted, self.targets_filled = [], {}  # what the steps wrote
        self.identities = {d: f"serial-{d[-1]}/2050048" for d in [*DEVICES, SPARE]}

    def facts(self):
        pvs = {path: dict(pv) for path, pv in self.pvs.items()}
        return {
            "pvs": pvs,
            "luks": copy.deepcopy(self.luks),
            "open": [n for n, d in self.open.items() if d],
            "open_elsewhere": [],
            "moving": self.moving,
            "crypttab": list(self.crypttab),
            "signatures": {d: list(self.signatures.get(d, [])) for d in [*DEVICES, SPARE]},
            "blkid_uuid": {
                d: (
                    self.luks[d]["uuid"]
                    if d in self.luks
                    else f"pv-{d}"
                    if "LVM2_member" in self.signatures.get(d, [])
                    else None
                )
                for d in [*DEVICES, SPARE]
            },
            "identity": dict(self.identities),
        }

    def perform(self, step, ledger):
        action = step["action"]
        target = step.get("target") or {}
        if action == "format":
            assert self.pvs.get(target["device"], {}).get("vg") in (None, "")
            self.formatted.append(target["device"])
            self.pvs.pop(target["device"], None)
            self.luks[target["device"]] = {
                "uuid": target["uuid"],
                "opens": True,
                "dated": False,
                "keyslots": 1,
            }
            self.signatures[target["device"]] = ["crypto_LUKS"]
        elif action == "open":
            self.open[target["name"]] = target["device"]
        elif action == "crypttab":
            self.crypttab.append(target["name"])
        elif action == "date":
            self.luks[target["device"]]["dated"] = True
        elif action == "pvcreate":
            self.pvs[step["path"]] = {
                "vg": "",
                "pe_count": LUN_EXTENTS - 4,
                "alloc": 0,
                "extent": EXTENT,
                "uuid": None,
            }
        elif action == "vgextend":
            self.pvs[step["path"]]["vg"] = self.vg
        elif action == "move":
            source, dest = self.pvs[step["source"]], self.pvs[step["path"]]
            assert dest["alloc"] == 0, "two sources on one PV"
            dest["alloc"], source["alloc"] = source["alloc"], 0
        elif action == "release":
            if step["source"] not in ledger["freed"]:
                ledger["freed"].append(step["source"])
                if step.get("pv_uuid"):
                    ledger["freed_pv"][step["source"]] = step["pv_uuid"]
                if step.get("identity"):
                    ledger["identity"][step["source"]] = step["identity"]
            self.pvs[step["source"]]["vg"] = ""
        elif action == "fill":
            self.targets_filled[step["name"]] = True
            ledger["filled"].append(step["name"])
        elif action == "pvremove":
            del self.pvs[step["path"]]
        elif action == "close":
            del self.open[step["name"]]
        elif action == "uncrypttab":
            self.crypttab.remove(step["name"])
        elif action == "erase":
            del self.luks[step["device"]]
            self.signatures[step["device"]] = []
        elif action == "finish":
            ledger["done"] = True
        else:
            raise AssertionError(step)


def run(host, ledger, limit=200, stop_after=None):
    """Steps until done; [actions]. ``stop_after``: a kill after that many steps."""
    actions = []
    for _ in range(limit):
        step = moves.next_step(host.plan, host.facts(), ledger)
        if step["action"] in ("done", "refuse"):
            return [*actions, step["action"]], step
        if stop_after is not None and len(actions) == stop_after:
            return actions, step
        host.perform(step, ledger)
        actions.append(step["action"])
    raise AssertionError(f"no end after {limit} steps: {actions[-10:]}")


def blank_ledger():
    return {
        **moves.new_ledger(),
        "spare_blank": True,
        "spare_device": SPARE,
        "identity": {SPARE: f"serial-{SPARE[-1]}/2050048"},
    }


# ---- the pillar --------------------------------------------------------------------------------


def test_the_pillar_names_the_spare_and_the_route_and_keeps_the_crypt_names_by_position():
    assert errors_of(storage()) == []
    volume = volume_plan()
    assert volume["spare"] == {"name": "hana_data_spare", "device": SPARE}
    assert [c["name"] for c in volume["crypt"]] == ["hana_data_0", "hana_data_1", "hana_data_2"]
    assert [c["device"] for c in volume["crypt"]] == DEVICES


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"in_place_spare": DEVICES[0]}, "is one of the volume's devices"),
        ({"encryption": "above_lvm"}, "for the encryption in place below LVM only"),
        ({"encrypt_in_place": False}, "for the encryption in place below LVM only"),
    ],
)
def test_a_spare_that_cannot_serve_is_refused_naming_its_key(change, says):
    errors = errors_of(storage(**change))
    assert any(says in e and "volumes:data:in_place_spare" in e for e in errors), errors


def test_a_spare_another_volume_uses_is_refused():
    pillar = storage()
    pillar["volumes"]["log"] = {"mountpoint": "/hana/log", "devices": [SPARE]}
    assert any(f"{SPARE} is already used by volume" in e for e in errors_of(pillar)), errors_of(pillar)


def test_a_spare_crypt_name_another_volume_takes_is_refused():
    pillar = storage()
    pillar["volumes"]["log"] = {
        "mountpoint": "/hana/log",
        "devices": ["/dev/vdz"],
        "crypt_name": "hana_data_spare",
    }
    assert any("'hana_data_spare' is also used" in e for e in errors_of(pillar)), errors_of(pillar)


def test_the_example_pillars_spare_line_is_valid():
    assert errors_of(mutate("volumes:log:in_place_spare", SPARE)) != []  # not without encrypt_in_place
    pillar = mutate("volumes:log:encrypt_in_place", True)
    pillar["volumes"]["log"]["in_place_spare"] = "/dev/vdz"
    assert errors_of(pillar) == []


# ---- the chain -----------------------------------------------------------------------------------


def test_each_device_ends_under_the_crypt_name_of_its_position_and_the_spare_gives_its_extents_back():
    chain = moves.chain(volume_plan())
    assert [(m["source"], m["target"]["device"], m["target"]["name"]) for m in chain] == [
        ("/dev/vdb", SPARE, "hana_data_spare"),
        ("/dev/vdc", "/dev/vdb", "hana_data_0"),
        ("/dev/vdd", "/dev/vdc", "hana_data_1"),
        ("/dev/mapper/hana_data_spare", "/dev/vdd", "hana_data_2"),
    ]


def test_a_run_ends_encrypted_with_each_target_formatted_once_and_never_two_sources_on_one_pv():
    plan = the_plan()
    host, ledger = Host(plan), blank_ledger()
    actions, _ = run(host, ledger)
    assert actions[-1] == "done" and ledger["done"]
    assert host.formatted == [SPARE, *DEVICES]
    assert actions.count("move") == 4 and actions.count("release") == 4 and actions.count("fill") == 3
    assert [actions[-3], actions[-2]] == ["erase", "finish"]
    # every device a LUKS PV of the VG holding what it held before, under its own name; the spare blank
    assert {n: host.pvs[f"/dev/mapper/{n}"]["alloc"] for n in plan["final"]} == dict.fromkeys(
        plan["final"], 200
    )
    assert {d: host.pvs.get(d) for d in DEVICES} == dict.fromkeys(DEVICES)
    assert host.signatures[SPARE] == [] and SPARE not in host.luks and "hana_data_spare" not in host.open
    assert sorted(host.crypttab) == sorted(plan["final"])


def test_each_crypt_device_is_in_crypttab_and_its_key_dated_before_it_becomes_a_pv():
    host, ledger = Host(the_plan()), blank_ledger()
    for _ in range(100):
        step = moves.next_step(host.plan, host.facts(), ledger)
        if step["action"] == "done":
            break
        if step["action"] == "pvcreate":
            assert step["path"].removeprefix("/dev/mapper/") in host.crypttab
            device = next(
                m["target"]["device"] for m in host.plan["moves"] if m["target"]["name"] in step["path"]
            )
            assert host.luks[device]["dated"]  # what the audit measures the cryptoperiod from
        host.perform(step, ledger)


@pytest.mark.parametrize("kill_after", range(0, 40, 3))
def test_a_kill_after_any_step_goes_on_from_there_to_the_same_end(kill_after):
    plan = the_plan()
    host, ledger = Host(plan), blank_ledger()
    run(host, ledger, stop_after=kill_after)
    if not ledger["done"]:
        ledger = copy.deepcopy(ledger)  # what the file held; the runner starts again
        actions, _ = run(host, ledger)
        assert actions[-1] == "done"
    assert host.formatted == [SPARE, *DEVICES]


def test_the_percent_counts_the_moves_done_and_the_current_copy():
    host, ledger = Host(the_plan()), blank_ledger()
    assert moves.percent(host.plan, host.facts()) == 0
    run(host, ledger, stop_after=16)  # two of four moves done
    host.moving = {"percent": 50.0}
    assert moves.percent(host.plan, host.facts()) == 62


def test_an_interrupted_pvmove_is_resumed_before_anything_else():
    host, ledger = Host(the_plan()), blank_ledger()
    run(host, ledger, stop_after=6)  # format, open, crypttab, date, pvcreate, vgextend
    host.moving = {"percent": 37.5}
    step = moves.next_step(host.plan, host.facts(), ledger)
    assert step["action"] == "resume" and step["move"] == 0 and step["source"] == "/dev/vdb"
    assert "move 1 of 4 (/dev/vdb onto hana_data_spare) 38 %" in step["text"]


# ---- what is refused -----------------------------------------------------------------------------


def test_the_spare_is_formatted_only_when_found_blank_and_still_without_a_signature():
    host = Host(the_plan())
    step = moves.next_step(host.plan, host.facts(), moves.new_ledger())
    assert step["action"] == "refuse" and "was not found blank" in step["text"]
    host.signatures[SPARE] = ["xfs"]
    step = moves.next_step(host.plan, host.facts(), blank_ledger())
    assert step["action"] == "refuse" and "now carries xfs" in step["text"]


def test_a_device_not_freed_by_these_moves_is_never_formatted():
    host, ledger = Host(the_plan()), blank_ledger()
    run(host, ledger, stop_after=8)  # the first move done, vdb released
    assert ledger["freed"] == ["/dev/vdb"]
    ledger["freed"] = []  # a ledger that lost it
    step = moves.next_step(host.plan, host.facts(), ledger)
    assert step["action"] == "refuse" and "/dev/vdb, which these moves have not released" in step["text"]
    ledger["freed"] = ["/dev/vdb"]
    host.signatures["/dev/vdb"] = ["ext4"]  # someone used it meanwhile
    step = moves.next_step(host.plan, host.facts(), ledger)
    assert step["action"] == "refuse" and "now carries ext4" in step["text"]
    host.signatures["/dev/vdb"] = ["LVM2_member"]
    host.pvs["/dev/vdb"]["vg"] = "vg_other"  # vgextended into another VG meanwhile
    step = moves.next_step(host.plan, host.facts(), ledger)
    assert step["action"] == "refuse" and "is a PV of volume group 'vg_other'" in step["text"]


def test_luks_these_moves_did_not_make_is_neither_opened_formatted_nor_erased():
    host, ledger = Host(the_plan()), blank_ledger()
    host.luks[SPARE] = {"uuid": "someone-else", "opens": True, "dated": True}
    step = moves.next_step(host.plan, host.facts(), ledger)
    assert step["action"] == "refuse" and "these moves did not make" in step["text"]


def test_our_luks_header_without_a_keyslot_is_a_cut_luksformat_and_is_formatted_again():
    host, ledger = Host(the_plan()), blank_ledger()
    host.luks[SPARE] = {"uuid": "u-hana_data_spare", "opens": False, "dated": False, "keyslots": 0}
    host.signatures[SPARE] = ["crypto_LUKS"]
    assert moves.next_step(host.plan, host.facts(), ledger)["action"] == "format"


def test_a_target_too_small_or_already_holding_extents_is_refused():
    host, ledger = Host(the_plan(), alloc=(249, 200, 200)), blank_ledger()
    actions, step = run(host, ledger)
    assert actions[-1] == "refuse" and "holds 246 extents and /dev/vdb has 249" in step["text"]
    host, ledger = Host(the_plan()), blank_ledger()
    run(host, ledger, stop_after=6)
    host.pvs["/dev/mapper/hana_data_spare"]["alloc"] = 3
    step = moves.next_step(host.plan, host.facts(), ledger)
    assert step["action"] == "refuse" and "two stripes of an LV on one PV" in step["text"]


def test_the_room_check_before_the_first_step_names_how_much_each_lun_must_grow():
    host = Host(the_plan(), alloc=(250, 250, 250))
    sizes = dict.fromkeys([*DEVICES, SPARE], (LUN_EXTENTS * EXTENT) + (1 << 20))
    errors = moves.room_errors(host.plan, host.facts(), sizes)
    assert len(errors) == 4 and "grow each LUN by 16 MiB or more" in errors[0]
    assert (
        moves.room_errors(
            Host(the_plan(), alloc=(246, 246, 246)).plan, Host(the_plan(), alloc=(246,) * 3).facts(), sizes
        )
        == []
    )


def test_a_plan_or_ledger_not_as_written_is_refused_with_its_own_error():
    with pytest.raises(moves.MovesError):
        moves.check_plan({"vg": "x"})
    plan = the_plan()
    plan["flag_options"] = ["; rm -rf /"]
    with pytest.raises(moves.MovesError):
        moves.check_plan(plan)
    with pytest.raises(moves.MovesError):
        moves.check_ledger({"freed": "/dev/vdb"})
    with pytest.raises(moves.MovesError):
        moves.check_ledger({"surprise": 1})
    assert moves.check_plan(the_plan()) and moves.check_ledger({}) == moves.new_ledger()


def test_the_unit_names_the_key_by_its_file_only_and_runs_the_minions_python():
    argv = moves.unit_argv(
        "data", "hana-storage-encrypt-hana_data.service", "/opt/saltstack/salt/bin/python3.10", "/x"
    )
    assert argv[:2] == ["systemd-run", "--unit=hana-storage-encrypt-hana_data.service"]
    assert "--setenv=PYTHONPATH=/x" in argv and argv[-1] == "data"
    assert not any("key" in a for a in argv)


def test_drop_entry_removes_only_that_name():
    text = "# c\nhana_data_spare UUID=a none luks\nhana_data_0 UUID=b none luks\n"
    assert tab.drop_entry(text, "crypttab", "hana_data_spare") == "# c\nhana_data_0 UUID=b none luks\n"


# ---- the SLS -----------------------------------------------------------------------------------


def test_while_the_moves_run_the_volume_has_only_their_state_which_runs_after_its_key(tmp_path):
    states = rendered_all(tmp_path, storage(), moving=("data",))
    data = sorted(s for s in states if s.startswith("hana-storage-data-"))
    assert data == ["hana-storage-data-moves"], data
    assert requires(states["hana-storage-data-moves"]["hana_storage.moved_onto_luks"]) == [
        "hana-storage-key-default"
    ]
    after = rendered_all(tmp_path, storage(), ("guard.sls", "luks.sls", "lvm.sls", "crypttab.sls"))
    assert "hana-storage-data-moves" not in after and "hana-storage-data-crypttab-2" in after


def test_after_a_boot_that_opened_nothing_each_luks_pv_made_so_far_is_opened_before_the_pvmove_resumes():
    """A pillar key's file is on a ramfs: the boot opens none of the new PVs, their VG is not
    whole, and the pvmove cannot resume until they are open."""
    plan = the_plan()
    host, ledger = Host(plan), blank_ledger()
    run(host, ledger, stop_after=22)  # two moves done, the third target ready
    assert host.pvs["/dev/mapper/hana_data_1"]["vg"] == host.vg
    host.open, host.moving = {}, {"percent": 12.0}
    opened = []
    for _ in range(5):
        step = moves.next_step(plan, host.facts(), ledger)
        if step["action"] != "open":
            break
        opened.append(step["target"]["name"])
        host.perform(step, ledger)
    assert opened == ["hana_data_spare", "hana_data_0", "hana_data_1"] and step["action"] == "resume"


def test_a_released_spare_is_not_opened_again_on_its_way_out():
    host, ledger = Host(the_plan()), blank_ledger()
    actions, _ = run(host, ledger)
    assert actions.count("open") == 4 and actions[-4:] == ["uncrypttab", "erase", "finish", "done"]
