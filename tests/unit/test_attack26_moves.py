"""Attack 26: a second pass on the encryption in place below LVM. Each test asserts the safe
behaviour; those whose name says HOLE failed after the attack-25 fixes: a stale wiping mark or a
renumbered spare path letting another disk be formatted, a PV of the VG the pillar does not
name left raw, a resume that names no target, a first extent past what the scrub zeroed, XFS
options a remount ignores remounted for at every apply."""

import pytest
from hana_storage_core import move_runner, moves

from tests.unit.test_events import load
from tests.unit.test_moves import DEVICES, SPARE, Host, blank_ledger, the_plan

states = load("_states/hana_storage.py", "hana_storage_state_attack26_moves")
MIB = 1 << 20
SPARE_PV = "/dev/mapper/hana_data_spare"


class RunnerHost(Host):
    """Host, with the ledger writes move_runner.perform makes that Host.perform leaves out (the
    'wiping' mark of a freed device's format), and a boot that closes every LUKS PV (a pillar
    key: crypttab lines noauto) and restores its PV when the runner opens it again."""

    closed = None

    def perform(self, step, ledger):
        target = step.get("target") or {}
        if step["action"] == "format" and target["device"] != self.plan["spare"]["device"]:
            ledger["wiping"] = target["device"]  # as move_runner.perform writes it, with the identity
            if step.get("identity") and target["device"] not in ledger["identity"]:
                ledger["identity"][target["device"]] = step["identity"]
        if step["action"] == "open" and self.closed and moves.mapper(target["name"]) in self.closed:
            self.pvs[moves.mapper(target["name"])] = self.closed.pop(moves.mapper(target["name"]))
        super().perform(step, ledger)
        if step["action"] in ("format", "open") and hasattr(move_runner, "_formatted"):  # the patch's
            saved = move_runner.write_json
            move_runner.write_json = lambda path, data: None
            try:
                move_runner._formatted(self.plan, ledger, target["device"])
            finally:
                move_runner.write_json = saved

    def boot(self):
        self.closed = {p: self.pvs.pop(p) for p in list(self.pvs) if p.startswith("/dev/mapper/")}
        self.open = {}

    def renumber(self, path):
        """``path`` now names another disk: no signature LVM or blkid knows (an SBD LUN, a LUN used
        raw), while the LUKS PV that was there sits under a path the plan does not name."""
        self.luks.pop(path, None)
        self.pvs.pop(path, None)
        self.signatures[path] = []


def _until(host, ledger, limit=60):
    for _ in range(limit):
        step = moves.next_step(host.plan, host.facts(), ledger)
        if step["action"] in ("format", "refuse", "done"):
            return step
        host.perform(step, ledger)
    raise AssertionError("no end")


def test_HOLE_the_stale_wiping_mark_formats_another_disk_behind_a_renumbered_path():
    """HOLE: ledger['wiping'] is set before a freed device's wipefs/luksFormat and never cleared.
    Move 2 (/dev/vdc onto hana_data_0 on /dev/vdb) runs for hours; a boot in it (pillar key: no
    LUKS PV opens) renumbers /dev/vdb to a disk without a signature. _may_format's first exception
    ('our wipefs cut short') matches the stale mark: wipefs -a + luksFormat on that disk. The
    freed_pv UUID check (attack-25 #7) is never reached."""
    host, ledger = RunnerHost(the_plan()), blank_ledger()
    steps = 0
    while True:  # up to hana_data_0 a PV of the VG, before move 2's pvmove
        step = moves.next_step(host.plan, host.facts(), ledger)
        host.perform(step, ledger)
        steps += 1
        if step["action"] == "vgextend" and step["move"] == 1:
            break
    assert ledger["wiping"] in ("/dev/vdb", None)  # main: stale, /dev/vdb carries our LUKS already
    host.boot()
    host.renumber("/dev/vdb")
    step = _until(host, ledger)
    assert step["action"] != "format", f"wipefs -a + luksFormat on the disk now at /dev/vdb: {step['text']}"


@pytest.mark.parametrize("after", ["vgextend", "move"])
def test_HOLE_a_renumbered_spare_path_is_formatted_on_spare_blank_alone(after):
    """HOLE: the spare's exception in _may_format is 'the ledger found it blank and it carries no
    signature now'. After the spare's luksFormat that is never true of the spare itself: a spare
    path without LUKS is another disk. With a pillar key a boot opens nothing, the real spare
    (holding all of /dev/vdb's extents after move 1) sits at another path, and the runner formats
    whatever signature-less disk now answers to /dev/vde."""
    host, ledger = RunnerHost(the_plan()), blank_ledger()
    while True:
        step = moves.next_step(host.plan, host.facts(), ledger)
        host.perform(step, ledger)
        if step["action"] == after and step["move"] == 0:
            break
    host.boot()
    host.renumber(SPARE)
    step = _until(host, ledger)
    assert step["action"] != "format", step["text"]


def test_HOLE_resume_names_no_destination_so_a_fresh_pvmove_may_land_anywhere(monkeypatch):
    """HOLE (defence in depth): 'moving' is ANY pvmove LV in the VG (an admin's, or one that
    finished between read_facts and the command). 'pvmove -i 10 <source>' then starts a NEW move
    of the source with the VG's normal allocation - onto a raw PV still to be moved, or onto a
    LUKS PV that holds another stripe. With source None it is a bare 'pvmove', which restarts
    every interrupted pvmove on the host. LVM ignores further PV arguments when it resumes
    ('Detected pvmove in progress ... Ignoring remaining command line arguments'), so naming
    the move's target costs nothing."""
    plan = the_plan()
    host, ledger = Host(plan), blank_ledger()
    while True:
        step = moves.next_step(plan, host.facts(), ledger)
        if step["action"] == "move":
            break
        host.perform(step, ledger)
    host.moving = {"percent": 0.0}  # e.g. an admin's pvmove of another PV of the VG
    step = moves.next_step(plan, host.facts(), ledger)
    assert step["action"] == "resume"
    ran = []
    monkeypatch.setattr(move_runner, "_run", lambda argv, check=True, stdin=None: ran.append(argv))
    move_runner.perform(plan, ledger, step)
    pvmove = [a for a in ran if a[0] == "pvmove"][0]
    assert SPARE_PV in pvmove, f"resume without a destination: {pvmove}"


# ---- a PV of the VG the pillar does not name -------------------------------------------------


def test_HOLE_a_pv_of_the_vg_outside_the_pillars_devices_is_never_moved_and_the_route_ends_done(
    monkeypatch,
):
    """HOLE (medium): _moves_refused checks that every pillar device is a PV of the VG, not that
    the VG has no other PV; read_facts keeps the plan's paths only. A VG extended by hand with
    /dev/vdx (holding 50 extents of the LV) starts, and ends 'every PV moved onto LUKS', with a
    raw PV under the LV."""
    from tests.unit.test_moves import volume_plan  # noqa: PLC0415

    plan = the_plan()
    facts = Host(plan).facts()
    facts["pvs"]["/dev/vdx"] = {"vg": plan["vg"], "pe_count": 250, "alloc": 50, "extent": 4 << 20}
    blank = {"device": SPARE, "exists": True, "block": True, "signatures": [], "pttype": None,
             "holders": [], "mountpoints": [], "data_at": None, "lvm_sees_paths": []}  # fmt: skip
    monkeypatch.setattr(states, "_probe", lambda device, key_file=None: dict(blank))
    monkeypatch.setattr(
        states,
        "__salt__",
        {
            "hana_storage_host.block_bytes": lambda d: 1 << 40,
            "hana_storage_host.vg_pvs": lambda vg: {"pvs": [*DEVICES, "/dev/vdx"]},
        },  # fmt: skip
        raising=False,
    )
    refused = states._moves_refused(volume_plan(), plan, facts)
    assert refused and "/dev/vdx" in refused, refused


def test_a_pvmove_in_the_vg_that_is_none_of_these_moves_is_refused_not_polled_bare():
    plan = the_plan()
    host, ledger = Host(plan), blank_ledger()
    from tests.unit.test_moves import run  # noqa: PLC0415

    run(host, ledger, stop_after=32)  # every move released, fills next
    host.moving = {"percent": 3.0}
    step = moves.next_step(plan, host.facts(), ledger)
    assert step["action"] == "refuse" or step.get("source"), step


@pytest.mark.parametrize(
    ("pe_start", "expect"), [(32 * MIB, ["pvremove", "zero", "pvcreate", "vgextend"]), (MIB, ["vgextend"])]
)
def test_a_pv_whose_first_extent_lvm_put_past_the_scrubbed_head_is_made_again_over_zeros(
    monkeypatch, pe_start, expect
):
    """_fit_head, in the vgextend step: pe_start 32 MiB (io_opt 32 MiB) -> pvremove, zeros up to
    32 MiB, pvcreate, then vgextend; a PV within 16 MiB is left alone."""
    path = "/dev/mapper/hana_data_0"
    ran = []
    monkeypatch.setattr(move_runner, "_real", lambda p: p)
    monkeypatch.setattr(
        move_runner, "pv_rows", lambda: {path: {"vg": "", "pe_start": pe_start, "pe_count": 1, "alloc": 0}}
    )
    monkeypatch.setattr(move_runner, "_run", lambda argv, check=True, stdin=None: ran.append(argv[0]))
    monkeypatch.setattr(
        move_runner, "_zero", lambda p, o, n: ran.append("zero") if (o, n) == (0, pe_start) else None
    )
    move_runner.perform(the_plan(), blank_ledger(), {"action": "vgextend", "path": path, "move": 1})
    assert ran == expect
