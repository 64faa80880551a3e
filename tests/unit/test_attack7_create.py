"""Attacks on the steps that replaced ``unless`` (hana_storage.vg_present, lv_present and
units_enabled) and on lab/guest_watch.py. Each test states what should hold and fails while the
hole is open; the docstrings name the scenario and its consequence."""

# ruff: noqa: F811 - the fixtures imported from test_states and test_attack5_growth are parameters

import importlib.util
import json
import subprocess
import sys
import time

import pytest
import salt.states.lvm as salt_lvm
from hana_storage_core import lvm
from salt.exceptions import CommandExecutionError

from tests.conftest import REPO
from tests.unit.test_attack5_growth import core_lv, lv_steps, step_args  # noqa: F401
from tests.unit.test_lab_watch import watch
from tests.unit.test_states import (  # noqa: F401  (fixtures: pytest finds them by name here)
    configure_loader_modules,
    dry_run,
    marks,
    opts,
    pillar_data,
    salt_functions,
    scratch,
    states,
    tabs,
)

sys.path.insert(0, str(REPO / "lab"))
import guest_watch  # noqa: E402

MPATH = [f"/dev/mapper/mpath{c}" for c in "abc"]
IGNORE_SUSPENDED = lvm.NO_SUSPENDED[1]


@pytest.fixture
def host(monkeypatch):
    """The formula's host module (vg_pvs, lv_room) over an LVM given by ``lvm_host``."""
    spec = importlib.util.spec_from_file_location("host_attack7", REPO / "_modules" / "hana_storage_host.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module.salt.utils.path, "which", lambda name: f"/usr/sbin/{name}")
    return module


def lvm_host(host, monkeypatch, pvs, segments, suspended=()):
    """LVM on the host: ``pvs`` ({pv: vg}) and the LV ``segments``; a report run with
    ``ignore_suspended_devices = 1`` does not scan the ``suspended`` devices (dm devices whose I/O
    is suspended: a multipath map while multipathd reloads its table, a crypt mapping during a
    ``cryptsetup refresh``/``resize`` or after ``luksSuspend``), so what lives only on them is
    not in it. Without that option LVM waits for them to be resumed and then reports all."""

    def run(argv):
        skipped = set(suspended) if IGNORE_SUSPENDED in argv else set()
        if argv[0] == "pvs":
            rows = [
                {
                    "pv_name": pv,
                    "vg_name": owner,
                    "pv_pe_count": "255",
                    "dev_size": str(1 << 30),
                    "pe_start": str(1 << 20),
                    "pv_mda_count": "1",
                    "pv_mda_size": "1044480",
                    "pv_pe_alloc_count": "100",
                    "pv_allocatable": "allocatable",
                    "vg_extent_size": str(4 << 20),
                }
                for pv, owner in pvs.items()
                if pv not in skipped
            ]
            return json.dumps({"report": [{"pv": rows}]}), None
        if argv[0] == "lvs":
            rows = [
                {
                    "lv_name": s["lv"],
                    "vg_name": s["vg"],
                    "lv_uuid": "u",
                    "lv_dm_path": f"/dev/mapper/{s['vg']}-{s['lv']}",
                    "segtype": "striped",
                    "stripes": str(len(s["devices"])),
                    "stripe_size": "65536",
                    "seg_start": "0",
                    "seg_size": str(800 << 20),
                    "devices": ",".join(f"{d}(0)" for d in s["devices"]),
                }
                for s in segments
                if not set(s["devices"]) <= skipped  # a VG none of whose PVs is scanned is not found
            ]
            return json.dumps({"report": [{"seg": rows}]}), None
        raise AssertionError(f"unexpected command {argv}")

    monkeypatch.setattr(host, "_run", run)


def read_lvs(salt_functions, host):
    """The state reads the LVs through the host module (lv_room, or lv_segments where it has it)."""
    for name in ("lv_room", "lv_segments"):
        if hasattr(host, name):
            salt_functions[f"hana_storage_host.{name}"] = getattr(host, name)


def salt_lvm_module(monkeypatch, functions, test=False):
    """Salt's own lvm states (3008.5) over ``functions``, reached as the formula reaches them."""
    monkeypatch.setattr(salt_lvm, "__salt__", functions, raising=False)
    monkeypatch.setattr(salt_lvm, "__opts__", {"test": test}, raising=False)
    monkeypatch.setattr(
        states,
        "__states__",
        {"lvm.vg_present": salt_lvm.vg_present, "lvm.lv_present": salt_lvm.lv_present},
        raising=False,
    )


# ---- 1. "not in a report that skips suspended devices" is taken for "absent" ---------------------


def test_a_vg_on_suspended_pvs_is_not_vgextended_under_test_mode(salt_functions, dry_run, host, monkeypatch):
    """vg_hana_data lives on mpatha and mpathb; the pillar adds mpathc, an orphan PV (the SAN
    team's pvcreate, or an apply killed after pv-2). While the apply reaches the vg step both maps
    are suspended (multipathd reloading them after a path event). vg_pvs reads
    ``pvs --config 'devices { ignore_suspended_devices = 1 }'``: no PV of the VG, so "absent",
    and Salt's lvm.vg_present is called. Its own ``vgdisplay`` (without that option) waits for the
    resume, finds the VG, and runs ``vgextend vg_hana_data /dev/mapper/mpathc`` -- under
    test=True, the very thing the step exists to prevent. (vgcreate itself refuses an existing
    name: "absent" should be proven by LVM, not by a report that may skip devices.)"""
    lvm_host(
        host, monkeypatch, {MPATH[0]: "vg_hana_data", MPATH[1]: "vg_hana_data", MPATH[2]: ""}, [], MPATH[:2]
    )
    salt_functions["hana_storage_host.vg_pvs"] = host.vg_pvs
    vgextended = []
    owner = {MPATH[0]: "vg_hana_data", MPATH[1]: "vg_hana_data", MPATH[2]: ""}
    salt_lvm_module(
        monkeypatch,
        {
            "lvm.vgdisplay": lambda name, quiet=False: {name: {"Volume Group Name": name}},
            "lvm.pvdisplay": lambda dev, real=False: {dev: {"Volume Group Name": owner[dev]}},
            "lvm.vgextend": lambda vg, dev: vgextended.append((vg, dev)) or owner.update({dev: vg}),
            "lvm.vgcreate": lambda *a, **kw: pytest.fail("the VG exists"),
        },
        test=True,
    )
    ret = states.vg_present("vg_hana_data", MPATH)
    assert not vgextended, f"vgextend under test=True: {vgextended} ({ret})"


def test_an_lv_on_suspended_pvs_is_not_resized_by_salts_lv_present(
    tmp_path, salt_functions, host, monkeypatch, core_lv
):
    """lv_hana_data (800 MiB, 2 stripes over mpatha and mpathb) exists; the pillar asks 1000M.
    At the lv step both maps are suspended (a multipath reload): ``lvs`` with
    ignore_suspended_devices = 1 does not see the VG, lv_room gives no segment, and Salt's
    lv_present is called. Its ``lvdisplay`` waits for the resume, finds the LV and runs
    ``lvresize -L 1000M`` -- no --stripes, no PV list: the tail lands anywhere in the VG, outside
    the stripes lv_extended keeps (what the change set out to prevent)."""
    steps = lv_steps(tmp_path, {"devices": MPATH[:2], "stripe_size": 64, "size": "1000M"})
    step = step_args(steps["hana-storage-data-lv"]["hana_storage.lv_present"])
    calls = core_lv(200)  # Salt's lvm.lvdisplay: the LV exists, 200 extents of 4 MiB
    monkeypatch.setattr(states, "__states__", {"lvm.lv_present": salt_lvm.lv_present}, raising=False)
    segment = {"lv": "lv_hana_data", "vg": "vg_hana_data", "devices": MPATH[:2]}
    lvm_host(host, monkeypatch, dict.fromkeys(MPATH[:2], "vg_hana_data"), [segment], MPATH[:2])
    read_lvs(salt_functions, host)
    ret = states.lv_present(**step)
    assert not calls["lvresize"], f"an existing LV resized without its stripes: {calls['lvresize']} ({ret})"


# ---- 2. a new LV is put on PVs the pillar does not name -----------------------------------------


def test_a_new_lv_is_created_only_on_the_pillars_pvs(tmp_path, salt_functions, monkeypatch):
    """The pillar gives the volume mpathb and mpathc (2 stripes). vg_hana_data exists already and
    also holds mpatha (the SAN team created the VG with a spare LUN, or a device was dropped from
    the pillar after an apply stopped before the lv step); the LV does not exist. lv_present hands
    Salt's lv_present no PV list: ``lvcreate -l 100%FREE -i 2 -I 64k`` lets LVM choose, and it
    takes the first PVs with room (verified with LVM 2.03.16: mpatha and mpathb). HANA's data then
    lives on a LUN the pillar does not name (which the owner may reclaim), one named LUN stays
    unused, and lv_extended -- which never uses a PV the pillar does not name -- cannot repair the
    geometry. The LV should be created over the pillar's PVs only."""
    steps = lv_steps(tmp_path, {"devices": MPATH[1:], "stripe_size": 64})
    step = step_args(steps["hana-storage-data-lv"]["hana_storage.lv_present"])
    room = [
        {
            "pv": pv,
            "vg": "vg_hana_data",
            "extents": 255,
            "free": 255,
            "allocatable": True,
            "extent_bytes": 4 << 20,
        }
        for pv in MPATH
    ]
    salt_functions["hana_storage_host.lv_room"] = lambda path: {"segments": [], "pvs": room}
    salt_functions["hana_storage_host.lv_segments"] = lambda path: {"segments": []}
    created, lvpath = [], "/dev/vg_hana_data/lv_hana_data"

    def lvcreate(name, vgname, pv=None, **kwargs):
        created.append(set(pv.replace(",", " ").split()) if isinstance(pv, str) else set(pv or ()))
        return {"Output from lvcreate": "created"}

    salt_lvm_module(
        monkeypatch,
        {
            "lvm.lvdisplay": lambda path, quiet=False: (
                {lvpath: {"Logical Volume Size": "1"}} if created else {}
            ),
            "lvm.lvcreate": lvcreate,
        },
    )

    def run_all(argv, **kwargs):  # a fix that runs lvcreate itself
        if argv[0] == "lvcreate":
            created.append({a for a in argv if a.startswith("/dev/") and a != lvpath})
        return {"retcode": 0, "stdout": "", "stderr": ""}

    salt_functions["cmd.run_all"].side_effect = run_all
    ret = states.lv_present(**step)
    assert created == [set(MPATH[1:])], f"the LV was created with PVs {created} ({ret})"


# ---- 3. units_enabled ---------------------------------------------------------------------------

UNITS = ["clevis-luks-askpass.path", "remote-cryptsetup.target"]


def test_a_unit_enabled_only_until_reboot_is_enabled_for_good(salt_functions):
    """An admin (or a rescue procedure) ran ``systemctl enable --runtime clevis-luks-askpass.path``:
    the link is in /run/systemd/system and goes with the next boot. ``systemctl -q is-enabled``
    exits 0 for ``enabled-runtime`` (verified, systemd 252), so units_enabled reports both units
    enabled and runs nothing; after the reboot nothing answers the Tang volumes' password prompt
    and they stay locked (HANA down) while every apply and test=True said "enabled"."""
    ran = []

    def run_all(argv, **kwargs):
        ran.append(list(argv))
        if "is-enabled" in argv:
            unit = argv[-1]
            state = "enabled-runtime" if unit == UNITS[0] else "enabled"
            return {"retcode": 0, "stdout": "" if "-q" in argv else state, "stderr": ""}
        return {"retcode": 0, "stdout": "", "stderr": ""}

    salt_functions["cmd.run_all"].side_effect = run_all
    ret = states.units_enabled("tang unlock at boot", UNITS)
    enabled = [argv for argv in ran if argv[:2] == ["systemctl", "enable"] and UNITS[0] in argv]
    assert enabled, f"{UNITS[0]} is enabled only until the next boot, and the state says: {ret['comment']}"


def test_a_missing_systemctl_is_a_failed_step_not_a_traceback(salt_functions):
    """A host without systemctl (a minimal image build, a non-systemd rescue system: where the
    docstring says the step works). cmd.run_all raises CommandExecutionError for a program it
    cannot start; units_enabled lets it through, so Salt reports the step as "An exception
    occurred in this state: Traceback ..." instead of a result False naming systemctl (the
    cmd.run it replaced failed with the shell's "systemctl: command not found")."""
    salt_functions["cmd.run_all"].side_effect = CommandExecutionError(
        "Unable to run command 'REDACTED' with the context '{}', reason: [Errno 2] No such file or "
        "directory: 'systemctl'"
    )
    try:
        ret = states.units_enabled("tang unlock at boot", UNITS)
    except CommandExecutionError as error:
        pytest.fail(f"units_enabled raised instead of failing the step: {error}")
    assert ret["result"] is False and "systemctl" in ret["comment"], ret


# ---- 4. lab/guest_watch.py ----------------------------------------------------------------------


def zombie(pid):
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_an_apply_that_ended_after_the_watched_step_is_reported_ended(tmp_path):
    """The watched change is the apply's last one (rotation: its last keyslot change) and the
    apply has ended by the next poll; the lab's Salt server has not reaped it yet (a zombie, as
    alive() itself expects). done() holds first, so kill_when goes straight to killpg, which
    succeeds on a group whose leader is a zombie: KILLED is printed for an apply nobody
    interrupted. test_enforce's ``assert "KILLED" in out`` then passes a step that was never
    interrupted, and test_rotation runs one more apply instead of stopping at ENDED."""
    flag = tmp_path / "step-done"
    apply = subprocess.Popen(["sh", "-c", f"touch {flag}"], start_new_session=True)
    deadline = time.monotonic() + 10
    while not zombie(apply.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        assert watch("kill", str(apply.pid), "holds", f"exists:{flag}") == "ENDED"
    finally:
        apply.wait()


def test_a_poll_of_the_header_backups_reads_a_few_blocks(tmp_path, monkeypatch):
    """test_rotation watches /etc/hana-storage/luks-headers: one ``cryptsetup luksHeaderBackup``
    per device, 16 MiB each for a default LUKS2 header. state_of hashes the first 16 MiB of every
    file on every 20 ms poll: 48 MiB of SHA-256 per poll for the three rotated devices (55 ms a
    poll natively, seconds under the lab's emulation): the watcher takes the whole vCPU the
    commit set out to give back to the apply, and its kill comes steps late. A change to a
    backup must still be seen."""
    backups = tmp_path / "luks-headers"
    backups.mkdir()
    for name in ("hana_data", "hana_log_0", "hana_log_1"):
        (backups / f"{name}.luks-header").write_bytes(b"LUKS\xba\xbe\x00\x02" + bytes((16 << 20) - 8))
    before = guest_watch.snapshot([str(backups)])
    with open(backups / "hana_log_0.luks-header", "r+b") as handle:  # a keyslot area rewritten
        handle.seek(8 << 20)
        handle.write(b"\x01" * 512)
    read = []
    head = guest_watch.head
    monkeypatch.setattr(
        guest_watch, "head", lambda path, size: read.append(len(head(path, size))) or head(path, size)
    )
    assert guest_watch.snapshot([str(backups)]) != before
    assert sum(read) <= 64 << 10, f"one poll read {sum(read) >> 20} MiB"
