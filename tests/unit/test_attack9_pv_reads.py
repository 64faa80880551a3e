"""Attacks on hana_storage.pv_present (the formula's own PV step, in place of Salt's
lvm.pv_present) and on the state run's shared LVM reports (``_read``). Each test states what should
hold and fails while the hole is open; the docstrings name the scenario and its consequence.

What LVM 2.03.16 does with ``pvcreate --yes`` was checked on loop devices: it refuses a PV of a
VG (also through a /dev symlink, of an exported VG, of a foreign VG that `pvs` does not even
list, or a duplicate): ``Can't initialize physical volume "<pv>" of volume group "<vg>" without
-ff``, exit 5; it re-labels an orphan PV (new PV UUID) and wipes a filesystem signature on
anything else without asking."""

# ruff: noqa: F811 - the fixtures imported from test_states are parameters

import importlib.util
import json

import pytest
from hana_storage_core import lvm
from salt.exceptions import CommandExecutionError

from tests.conftest import REPO
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

MPATH = [f"/dev/mapper/mpath{c}" for c in "abcd"]
IGNORE_SUSPENDED = lvm.NO_SUSPENDED[1]
# what LVM 2.03.16 answers `pvcreate --yes` on a PV of a VG (seen on a loop device)
REFUSED = 'Can\'t initialize physical volume "{pv}" of volume group "{vg}" without -ff\n  {pv}: physical volume not initialized.'


@pytest.fixture
def host(monkeypatch):
    """The formula's host module (pv_names, vg_pvs) with its own dunders, over ``Lvm`` below."""
    spec = importlib.util.spec_from_file_location("host_attack9", REPO / "_modules" / "hana_storage_host.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module.salt.utils.path, "which", lambda name: f"/usr/sbin/{name}")
    monkeypatch.setattr(module, "__context__", {}, raising=False)
    return module


class Lvm:
    """LVM on the host: ``owner`` {pv: its VG, '' for an orphan PV}. A `pvs` run with
    ``ignore_suspended_devices = 1`` (every report of the formula's) leaves out the PVs on the
    ``suspended`` dm devices: a multipath map while multipathd reloads its table after a path
    event, a crypt mapping during ``cryptsetup refresh``/``resize``. Any other command is
    recorded in ``ran``; ``pvcreate`` answers as LVM 2.03.16 does."""

    def __init__(self, owner, segments=()):
        self.owner, self.suspended, self.ran, self.reports = dict(owner), set(), [], []
        self.segments = list(segments)  # [{vg, lv, devices}]: one striped segment each

    def _lvs(self):
        rows = [
            {
                "lv_name": s["lv"],
                "vg_name": s["vg"],
                "lv_uuid": f"uuid-{s['lv']}",
                "lv_dm_path": f"/dev/mapper/{s['vg']}-{s['lv']}",
                "segtype": "striped",
                "stripes": str(len(s["devices"])),
                "stripe_size": "65536",
                "seg_start": "0",
                "seg_size": str(len(s["devices"]) * 255 * (4 << 20)),
                "devices": ",".join(f"{d}(0)" for d in s["devices"]),
            }
            for s in self.segments
        ]
        return json.dumps({"report": [{"seg": rows}]})

    def _pvs(self, argv):
        skipped = self.suspended if IGNORE_SUSPENDED in argv else set()
        vg = argv[argv.index("--select") + 1].removeprefix("vg_name=") if "--select" in argv else None
        rows = [
            {
                "pv_name": pv,
                "vg_name": owner,
                "pv_uuid": f"uuid-{pv[-1]}",
                "dev_size": str(1 << 30),
                "pv_size": str(1 << 30),
                "pv_pe_count": "255",
                "pe_start": str(1 << 20),
                "pv_mda_count": "1",
                "pv_mda_size": "1044480",
                "pv_pe_alloc_count": "255" if owner else "0",
                "pv_allocatable": "allocatable",
                "vg_extent_size": str(4 << 20),
            }
            for pv, owner in self.owner.items()
            if pv not in skipped and (vg is None or owner == vg)
        ]
        return json.dumps({"report": [{"pv": rows}]})

    def run_all(self, argv, **kwargs):
        if argv[0] in ("pvs", "lvs"):
            self.reports.append(argv[0])
            return {
                "retcode": 0,
                "stdout": self._pvs(argv) if argv[0] == "pvs" else self._lvs(),
                "stderr": "",
            }
        self.ran.append(list(argv))
        if argv[0] == "pvcreate":
            pv = argv[-1]
            if self.owner.get(pv):
                return {"retcode": 5, "stdout": "", "stderr": REFUSED.format(pv=pv, vg=self.owner[pv])}
            self.owner[pv] = ""
        return {"retcode": 0, "stdout": "", "stderr": ""}


def on_lvm(salt_functions, host, monkeypatch, owner, segments=(), lvm_host=None):
    """The states and the host module run their commands on one ``Lvm`` (``lvm_host``, or one
    over ``owner`` and ``segments``); the devices exist. As in a state run, the host module's
    functions share the states' __context__."""
    lvm_host = lvm_host or Lvm(owner, segments)
    monkeypatch.setattr(host, "__salt__", {"cmd.run_all": lvm_host.run_all}, raising=False)
    monkeypatch.setattr(host, "__context__", states.__context__, raising=False)
    salt_functions["cmd.run_all"].side_effect = lvm_host.run_all
    for name in ("pv_names", "vg_pvs", "lv_segments", "lv_room", "lv_geometry"):
        salt_functions[f"hana_storage_host.{name}"] = getattr(host, name)
    salt_functions["hana_storage_host.dm_suspended"] = lambda path: path in lvm_host.suspended
    fake_paths(monkeypatch, present=MPATH)
    return lvm_host


def pvcreates(lvm_host):
    return [argv for argv in lvm_host.ran if argv[0] == "pvcreate"]


# ---- 1. "not in a report that skips suspended devices" is taken for "no PV" ------------------------


def test_a_pv_of_the_vg_suspended_while_pvs_reads_is_not_pvcreated(salt_functions, host, monkeypatch):
    """An idempotent apply: vg_hana_data lives on mpatha and mpathb, both PVs of it, nothing to do.
    As pv-0 reads the one `pvs` of the run, multipathd reloads mpathb after a path event (a
    reload suspends the map for a moment). pv_names runs ``pvs --config 'devices {
    ignore_suspended_devices = 1 }'``: mpathb is not in the report, so pv-1 takes it for "no PV"
    and runs ``pvcreate --yes /dev/mapper/mpathb`` on a live PV of the volume's VG -- the command
    that wipes every signature it finds. Only LVM's own refusal (exit 5, "Can't initialize physical
    volume ... of volume group vg_hana_data without -ff") stops it, and the healthy volume's apply
    fails there: its VG, LV, LUKS, filesystem and mount steps are all skipped. Salt's
    lvm.pv_present asked ``pvdisplay`` without that option, which waited for the resume and found
    the PV. "No PV" should be proven by LVM seeing the device, not by a report that may skip it
    (as test_attack7 established for the VG)."""
    lvm_host = on_lvm(salt_functions, host, monkeypatch, dict.fromkeys(MPATH[:2], "vg_hana_data"))
    lvm_host.suspended = {MPATH[1]}
    results = [states.pv_present(pv) for pv in MPATH[:2]]
    assert not pvcreates(lvm_host), (
        f"pvcreate --yes on a live PV of vg_hana_data: {pvcreates(lvm_host)} ({results})"
    )


def test_a_suspension_seen_by_one_pv_step_is_not_kept_for_the_rest_of_the_run(
    salt_functions, host, monkeypatch
):
    """Two healthy volumes, an idempotent apply: data on mpatha/mpathb (vg_hana_data), log on
    mpathc/mpathd (vg_hana_log). data's pv-0 reads the run's `pvs` while multipathd reloads mpathc
    (suspended for a moment, so not in a report with ignore_suspended_devices = 1). The reload is
    over long before log's steps: log's guard probes mpathc afresh and finds a PV of its own VG.
    But no command ran in between (nothing to do for data), so log's pv-0 still works from the
    report read minutes earlier: "mpathc is no PV", and it runs ``pvcreate --yes`` on a live PV of
    vg_hana_log. Without the shared report its own `pvs` would have listed mpathc: the memo turns
    a reload's millisecond into the whole run, and a run over many LUNs (whose path events come
    in storms) reads its one report at the worst time as often as any. Only LVM's refusal stops
    the write, and the log volume's apply fails."""
    owner = {**dict.fromkeys(MPATH[:2], "vg_hana_data"), **dict.fromkeys(MPATH[2:], "vg_hana_log")}
    lvm_host = on_lvm(salt_functions, host, monkeypatch, owner)
    lvm_host.suspended = {MPATH[2]}
    for pv in MPATH[:2]:  # the data volume: its PVs are PVs
        assert states.pv_present(pv)["result"] is True
    lvm_host.suspended = set()  # multipathd's reload is over
    assert states.vg_present("vg_hana_data", MPATH[:2])["result"] is True
    assert states.vg_extended("vg_hana_data", MPATH[:2])["changes"] == {}
    assert not lvm_host.ran  # an idempotent apply: nothing ran, nothing dropped the report
    results = [states.pv_present(pv) for pv in MPATH[2:]]  # the log volume, later in the run
    assert not pvcreates(lvm_host), (
        f"pvcreate --yes on a live PV of vg_hana_log from a report read before its map resumed: "
        f"{pvcreates(lvm_host)} ({results})"
    )


def test_one_run_reads_each_lvm_report_once_until_it_changes_something(salt_functions, host, monkeypatch):
    """Salt's pv_present ran `pvdisplay` for every PV of every apply, and each PV, VG and LV step
    and each volume's guard read its own `pvs` or `lvs`: two dozen LVM scans of every device for
    an apply with nothing to do. The steps of one run share one `pvs` (the guard's, which it
    reads afresh) and one `lvs`, read again after any command the run ran."""
    vg, lv = "vg_hana_data", "/dev/vg_hana_data/lv_hana_data"
    segment = {"vg": vg, "lv": "lv_hana_data", "devices": MPATH[:2]}
    lvm_host = on_lvm(salt_functions, host, monkeypatch, dict.fromkeys(MPATH[:2], vg), [segment])
    states._ret("hana-storage-data-guard")  # a step opens the run's keeper
    assert host._pv_groups() == {"mpatha": vg, "mpathb": vg}  # the guard reads pvs afresh, kept
    for pv in MPATH[:2]:
        assert states.pv_present(pv)["result"] is True
    assert states.vg_present(vg, MPATH[:2])["result"] is True
    assert states.vg_extended(vg, MPATH[:2])["changes"] == {}
    assert states.lv_present(lv, "100%FREE", 2, 64, MPATH[:2])["result"] is True
    grown = states.lv_extended(lv, 2, 64, "100%FREE", MPATH[:2])
    assert grown["result"] is True and not grown["changes"], grown
    assert lvm_host.reports == ["pvs", "lvs"] and not lvm_host.ran
    # a new PV: not listed, so read again before pvcreate; after it, what was read may have
    # changed (read again), and vgextend acts on a report read at its step (read again)
    assert states.pv_present(MPATH[2])["changes"]
    assert states.vg_extended(vg, MPATH[:3])["changes"]
    assert lvm_host.reports == ["pvs", "lvs", "pvs", "pvs", "pvs"]
    assert [argv[0] for argv in lvm_host.ran] == ["pvcreate", "vgextend"]


def test_outside_a_state_run_each_report_is_read_afresh(host, monkeypatch):
    """The audit, the beacon and a remediation's checks read through the same functions; only a
    state run keeps what it read (a minion's own __context__ lives as long as the minion)."""
    lvm_host = Lvm(dict.fromkeys(MPATH[:2], "vg_hana_data"))
    monkeypatch.setattr(host, "__salt__", {"cmd.run_all": lvm_host.run_all}, raising=False)
    for _ in range(2):
        assert host.vg_pvs("vg_hana_data") == {"pvs": MPATH[:2]}
        assert host.lv_segments("/dev/vg_hana_data/lv_hana_data") == {"segments": []}
    assert lvm_host.reports == ["pvs", "lvs", "pvs", "lvs"]


# ---- 2. pvs that cannot be run ------------------------------------------------------------------


@pytest.mark.parametrize("test", [True, False], ids=["test", "apply"])
def test_pv_present_without_lvm2_installed_fails_cleanly(salt_functions, host, monkeypatch, opts, test):
    """`state.apply hana.storage test=True` on a host where lvm2 is not installed yet (packages.sls
    installs it in a real run; its pkg.installed does nothing under test), or a real apply where
    the package is gone: Salt's cmd.run_all raises CommandExecutionError ("Unable to run command
    ... No such file or directory: 'pvs'") for a program it cannot start. pv_names lets it
    through -- unlike _pv_groups and _read_lvm_segments beside it, which check for the program,
    and unlike the states' own _run ("a program that cannot be started is a failed command, not an
    exception"). pv_present then dies with a traceback in the state's comment instead of saying
    that the PVs cannot be read. pv_names should answer {"error": ...} as its docstring says, and
    pv_present fail (or, under test, wait) naming pvs."""
    opts["test"] = test

    def run_all(argv, **kwargs):
        raise CommandExecutionError(
            f"Unable to run command 'REDACTED' with the context '{{}}', reason: [Errno 2] No such file or "
            f"directory: '{argv[0]}'"
        )

    monkeypatch.setattr(host.salt.utils.path, "which", lambda name: None)
    monkeypatch.setattr(host, "__salt__", {"cmd.run_all": run_all}, raising=False)
    salt_functions["hana_storage_host.pv_names"] = host.pv_names
    try:
        found = host.pv_names()
    except CommandExecutionError as error:
        found = {"raised": str(error)}
    try:
        ret = states.pv_present(MPATH[0])
    except CommandExecutionError as error:
        ret = {"result": "raised", "comment": str(error)}
    assert "error" in found and "pvs" in found["error"], f"pv_names: {found}"
    assert ret["result"] in (False, None) and "pvs" in ret["comment"].lower(), f"pv_present: {ret}"
    salt_functions["cmd.run_all"].assert_not_called()
