"""Attacks on hana_storage.lun_grown (a LUN grown in place: ``multipathd resize map``, below LVM
``cryptsetup resize``, then ``pvresize``), its host function hana_storage_host.lun_growth and the
pure planner lun.plan. Each test states what should hold and fails while the hole is open; the
docstrings name the scenario and its consequence.

``Stack`` below is one LUN under one PV as the host shows it (sysfs, `dmsetup table`, `pvs` with
``ignore_suspended_devices = 1``), and what the three commands do to it: multipathd takes the
size of the map's first path (cli_resize), cryptsetup fits the LUKS device to what is under it and refuses a size that is no
multiple of the LUKS2 sector size (cryptsetup's crypt_resize: "Device size is not aligned to
requested sector size."), pvresize fits the PV's extents to its device."""

# ruff: noqa: F811 - the fixtures imported from test_states are parameters of the tests

import importlib.util
import json
import os

import pytest
from hana_storage_core import dm, lun

from tests.conftest import REPO
from tests.unit.test_lun_growth import BELOW, KEY, facts, room
from tests.unit.test_states import (  # noqa: F401  (fixtures: pytest finds them by name here)
    argvs_run,
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

MIB, EXTENT, GIB = 1 << 20, 4 << 20, 1 << 30
LUKS_OFFSET = 16 * MIB
MPATH, CRYPT = "/dev/mapper/mpatha", "/dev/mapper/hana_log_0"
REAL_REALPATH = os.path.realpath
SYSFS = "/sys/class/block"


class Stack:
    """The multipath map mpatha (dm-0, 253:0) over the paths ``paths`` {name: bytes}; below LVM
    the open LUKS2 device hana_log_0 (dm-1, 253:1) on it; the PV on top (``pv``: its path) with
    ``extents`` 4 MiB extents after a 1 MiB pe_start. ``others``: further PVs, {path: (kernel
    name, vg, extents, device bytes)}. ``suspended``: kernel names of suspended dm devices (left
    out of `pvs`)."""

    def __init__(
        self, paths, map_bytes, extents, below=True, crypt_bytes=None, sector=4096, vg="vg_hana_log"
    ):
        self.paths, self.map_bytes, self.below, self.sector = dict(paths), map_bytes, below, sector
        self.crypt_bytes = crypt_bytes if crypt_bytes is not None else map_bytes - LUKS_OFFSET
        self.pv = CRYPT if below else MPATH
        self.pvs = {self.pv: {"kname": "dm-1" if below else "dm-0", "vg": vg, "extents": extents}}
        self.others, self.suspended, self.ran = {}, set(), []
        self.links = {MPATH: "/dev/dm-0", CRYPT: "/dev/dm-1"}

    # -- what the host module reads
    def bytes_of(self, kname):
        if kname == "dm-0":
            return self.map_bytes
        if kname == "dm-1" and self.below:
            return self.crypt_bytes
        if kname in self.paths:
            return self.paths[kname]
        return next((o[3] for o in self.others.values() if o[0] == kname), None)

    def read(self, path):
        if not path.startswith(SYSFS + "/"):
            return ""
        kname, _, leaf = path[len(SYSFS) + 1 :].partition("/")
        if leaf == "size":
            size = self.bytes_of(kname)
            return "" if size is None else f"{size // 512}\n"
        dm_names = {"dm-0": ("mpatha", "mpath-3600a098038303053453f463045727a41")}
        if self.below:
            dm_names["dm-1"] = ("hana_log_0", "CRYPT-LUKS2-0123456789abcdef0123456789abcdef-hana_log_0")
        if kname in dm_names and leaf == "dm/name":
            return dm_names[kname][0] + "\n"
        if kname in dm_names and leaf == "dm/uuid":
            return dm_names[kname][1] + "\n"
        if kname in dm_names and leaf == "dm/suspended":
            return "1\n" if kname in self.suspended else "0\n"
        return ""

    def listdir(self, path):
        return sorted(self.paths) if path == f"{SYSFS}/dm-0/slaves" else []

    def kernel_name(self, path):
        return os.path.basename(self.realpath(path))

    def realpath(self, path):
        if path in self.links:
            return self.links[path]
        return REAL_REALPATH(path)

    def dev_of(self, path):
        return {"dm-0": "253:0", "dm-1": "253:1"}.get(self.kernel_name(path))

    def dm_tables(self):
        text = f"mpatha: 0 {self.map_bytes // 512} multipath 0 0 1 1 service-time 0 2 1 8:16 1 8:32 1\n"
        if self.below:
            options = "" if self.sector == 512 else f" 1 sector_size:{self.sector}"
            text += (
                f"hana_log_0: 0 {self.crypt_bytes // 512} crypt aes-xts-plain64 "
                f":64:logon:cryptsetup:0123-d0 0 253:0 {LUKS_OFFSET // 512}{options}\n"
            )
        return dm.parse_tables(text)

    def _pv_rows(self):
        rows = []
        entries = {p: (e["kname"], e["vg"], e["extents"], None) for p, e in self.pvs.items()}
        for path, (kname, vg, extents, size) in {**entries, **self.others}.items():
            if kname in self.suspended:
                continue  # ignore_suspended_devices = 1
            rows.append(
                {
                    "pv_name": path, "vg_name": vg, "pv_pe_count": str(extents),
                    "pv_pe_alloc_count": str(extents), "pv_allocatable": "allocatable",
                    "vg_extent_size": str(EXTENT), "dev_size": str(size or self.bytes_of(kname)),
                    "pe_start": str(MIB), "pv_mda_count": "1", "pv_mda_size": "1044480",
                }
            )  # fmt: skip
        return json.dumps({"report": [{"pv": rows}]})

    # -- what the commands do
    def run_all(self, argv, **kwargs):
        if argv[0] == "pvs":
            return {"retcode": 0, "stdout": self._pv_rows(), "stderr": ""}
        self.ran.append(list(argv))
        if argv[:3] == ["multipathd", "resize", "map"]:  # the size of its first path, as cli_resize
            self.map_bytes = self.paths[sorted(self.paths)[0]]
            return {"retcode": 0, "stdout": "ok", "stderr": ""}
        if argv[:2] == ["cryptsetup", "resize"]:
            fits = self.map_bytes - LUKS_OFFSET
            if fits <= 0:
                return {"retcode": 1, "stdout": "", "stderr": "Device mpatha is too small."}
            if fits % self.sector:
                return {
                    "retcode": 1,
                    "stdout": "",
                    "stderr": "Device size is not aligned to requested sector size.",
                }
            self.crypt_bytes = fits
            return {"retcode": 0, "stdout": "", "stderr": ""}
        if argv[0] == "pvresize":
            entry = next(
                (e for p, e in self.pvs.items() if self.realpath(p) == self.realpath(argv[-1])), None
            )
            if entry is None:  # another PV: resized all the same (a write to a device not ours)
                return {"retcode": 0, "stdout": "", "stderr": ""}
            size = self.bytes_of(entry["kname"])
            entry["extents"] = max(entry["extents"], (size - MIB) // EXTENT)
            return {"retcode": 0, "stdout": "", "stderr": ""}
        return {"retcode": 1, "stdout": "", "stderr": f"unexpected {argv}"}


@pytest.fixture
def host(monkeypatch):
    """The formula's host module with its own dunders."""
    spec = importlib.util.spec_from_file_location("host_attack12", REPO / "_modules" / "hana_storage_host.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module.salt.utils.path, "which", lambda name: f"/usr/sbin/{name}")
    monkeypatch.setattr(module, "__context__", {}, raising=False)
    return module


def on_stack(salt_functions, host, monkeypatch, stack):
    """The states and the host module over ``stack``, sharing the states' __context__."""
    monkeypatch.setattr(host, "__salt__", {"cmd.run_all": stack.run_all}, raising=False)
    monkeypatch.setattr(host, "__context__", states.__context__, raising=False)
    monkeypatch.setattr(host, "_read", stack.read)
    monkeypatch.setattr(host, "_listdir", stack.listdir)
    monkeypatch.setattr(host, "_kernel_name", stack.kernel_name)
    monkeypatch.setattr(host, "_dev_of", stack.dev_of)
    monkeypatch.setattr(host, "dm_tables", stack.dm_tables)
    monkeypatch.setattr(host.os.path, "realpath", stack.realpath)
    salt_functions["cmd.run_all"].side_effect = stack.run_all
    salt_functions["hana_storage_host.lun_growth"] = host.lun_growth
    salt_functions["hana_storage_host.dm_suspended"] = host.dm_suspended
    fake_paths(monkeypatch, present=[MPATH, CRYPT, *stack.others])
    return stack


def lun_grown(stack):
    return states.lun_grown(MPATH, stack.pv, KEY if stack.below else None)


# ---- the simulator holds: a grown LUN grows its PV once, and a second apply changes nothing --------


@pytest.mark.parametrize("below", [True, False], ids=["below_lvm", "above_lvm"])
def test_the_stack_grows_once_and_then_holds(salt_functions, host, monkeypatch, below):
    stack = on_stack(
        salt_functions, host, monkeypatch, Stack({"sdb": 2 * GIB, "sdc": 2 * GIB}, GIB, 0, below)
    )
    stack.pvs[stack.pv]["extents"] = (stack.bytes_of(stack.pvs[stack.pv]["kname"]) - MIB) // EXTENT
    ret = lun_grown(stack)
    assert ret["result"] is True and ret["changes"], ret
    assert [argv[0] for argv in stack.ran] == ["multipathd", *(["cryptsetup"] if below else []), "pvresize"]
    stack.ran.clear()
    again = lun_grown(stack)
    assert again["result"] is True and not again["changes"] and not stack.ran, again


# ---- 1. a LUN that shrank under its PV is reported as "spans all of" it ---------------------------


def test_a_pv_larger_than_what_is_under_it_is_refused_as_a_lun_that_shrank():
    """A SAN LUN shrunk on the array (a wrong LUN resized, a thin-provisioning mistake), the
    kernel's size rescanned, no multipath and no LUKS under the PV (above LVM): the PV's 255
    extents (1 GiB) now lie on a 512 MiB disk, its upper half beyond the device's end. The
    docstrings promise "a LUN that shrank is refused", and the plan does refuse it at the map and
    at the LUKS layer; at the PV it only asks whether pvresize would add extents, finds it would
    not, and returns no steps: lun_grown reports "<pv> spans all of <device>" (result True) for a
    volume whose LVM now maps extents onto nothing. Below LVM the same holds after a reboot (the
    LUKS device is opened on the smaller disk, so that layer agrees with it). Proof that a PV
    outgrew its device does not need LVM's metadata layout: its data area ends past the device
    (pe_start + extents x extent size > device bytes)."""
    with pytest.raises(lun.LunError, match="shrank"):
        lun.plan(facts(512 * MIB, pv=room(255, GIB)))


def test_lun_grown_does_not_call_a_shrunk_lun_healthy(salt_functions, host, monkeypatch):
    """The same through the state: the paths and the map agree at 512 MiB (multipathd already
    took the new size), the PV still has 255 extents of 4 MiB."""
    stack = on_stack(
        salt_functions,
        host,
        monkeypatch,
        Stack({"sdb": 512 * MIB, "sdc": 512 * MIB}, 512 * MIB, 255, below=False),
    )
    ret = lun_grown(stack)
    assert ret["result"] is False and "shrank" in ret["comment"], ret
    assert not stack.ran


# ---- 2. below LVM without a key file: a traceback ---------------------------------------------------


def test_lun_grown_below_lvm_without_a_key_file_fails_with_a_clear_error(salt_functions, monkeypatch):
    """``key_file`` defaults to None (it is needed below LVM only). A state called below LVM
    without it (a site's own SLS, an orchestration, a pillar renderer that drops the key)
    reaches core.commands.luks_resize(name, None): the argv holds None, and " ".join in
    _lun_steps_text raises TypeError. Salt reports a Python traceback for the state instead of
    "a key file is needed to resize the LUKS device"; "bad input gets a clear error, never a
    traceback". Nothing is run either way, but the failure names nothing an operator can act on."""
    monkeypatch.setattr(states.os.path, "exists", lambda path: True)
    salt_functions["hana_storage_host.lun_growth"] = lambda device, pv: BELOW
    ret = states.lun_grown(MPATH, CRYPT)
    assert ret["result"] is False and "key" in ret["comment"], ret
    assert argvs_run(salt_functions) == []


# ---- 3. a path whose size reads 0 (a failed path) -----------------------------------------------------


def test_a_path_whose_size_reads_zero_does_not_fail_a_lun_that_did_not_grow(
    salt_functions, host, monkeypatch
):
    """A healthy, idempotent apply on a host with one multipath path down: when a path fails
    while the SCSI layer revalidates it (READ CAPACITY fails), sd sets its capacity to 0, and the
    failed path stays a slave of the map until it is removed. The LUN did not grow: the map and
    every path that answers are 1 GiB. Taking {1 GiB, 0} for paths "that differ in size" fails
    lun_grown on every apply for as long as the path is down, and since lv_extended (and above
    LVM crypt_grown and the XFS growth after it) now require every lun_grown, a volume that got a
    new PV could no longer grow its LV either. (Holds with the host's filtering of paths that
    report no size; pinned here.)"""
    stack = Stack({"sdb": GIB, "sdc": 0}, GIB, 251)
    on_stack(salt_functions, host, monkeypatch, stack)
    ret = lun_grown(stack)
    assert ret["result"] is True and not ret["changes"] and not stack.ran, ret


def test_a_path_whose_size_reads_zero_stops_a_growth(salt_functions, host, monkeypatch):
    """The LUN grew to 2 GiB and two of its three paths were rescanned; the third (sdb) is down
    and reads 0. lun_growth leaves a path that reports no size out of the paths it compares, so
    the plan sees two paths that agree and runs ``multipathd resize map mpatha``. multipathd
    takes the new size from the first path of its first path group (cli_resize's
    VECTOR_SLOT(pgp->paths, 0), sysfs_get_size, which reads 0 as a valid size): where that is
    the failed path, the map is reloaded at 0 sectors under a live LUKS device and PV (every I/O
    of HANA fails), or, on versions that compare the paths, the resize is refused and lun_grown
    fails half-way. A path whose size is unknown cannot justify a resize: the plan should refuse
    while the others grew (and stay quiet while they did not, above), naming the failed path.
    ``Stack``'s multipathd takes the first path's size as the old cli_resize does."""
    stack = Stack({"sdb": 0, "sdc": 2 * GIB, "sdd": 2 * GIB}, GIB, 251)
    on_stack(salt_functions, host, monkeypatch, stack)
    ret = lun_grown(stack)
    assert not [argv for argv in stack.ran if argv[0] == "multipathd"], (stack.ran, stack.map_bytes, ret)
    assert ret["result"] is False and "sdb" in ret["comment"], ret


# ---- 4. a PV left out of `pvs` (suspended) is taken for a PV with nothing to do ---------------------


@pytest.mark.parametrize("test", [True, False], ids=["test", "apply"])
def test_a_pv_left_out_of_pvs_while_suspended_is_not_taken_for_done(
    salt_functions, host, monkeypatch, opts, test
):
    """An earlier apply resized the map and the LUKS device and was stopped before pvresize (a
    timeout, a kill, an LVM lock held by another tool): the PV still has its old 251 extents on a
    device 2 GiB - 16 MiB large. On this apply, as lun_growth reads `pvs` (``ignore_suspended_devices
    = 1``), the crypt device is suspended for a moment (multipathd reloading the map under it
    after a path event, a cryptsetup refresh). The PV is not in the report, so facts["pv"] is None,
    which lun.plan reads as "not a PV of a VG yet": no pv step, and lun_grown says "<pv> spans all
    of <device>" (result True, test mode too), while the PV lacks 256 extents. lun_grown runs after
    vg_extended proved the PV is in its VG: a PV missing from a report that leaves suspended devices
    out is unknown, not absent. vg_extended and pv_present fail with "<device> is suspended
    (multipathd reloading?) ... run again" in this case (_suspended); lun_grown should too."""
    opts["test"] = test
    stack = Stack({"sdb": 2 * GIB, "sdc": 2 * GIB}, 2 * GIB, 251)
    on_stack(salt_functions, host, monkeypatch, stack)
    stack.suspended = {"dm-1"}
    ret = lun_grown(stack)
    assert ret["result"] is False and "suspended" in ret["comment"], ret
    assert not stack.ran


# ---- 5. a LUN size cryptsetup resize refuses: test mode promises it, the apply fails half-way -------


def test_a_lun_grown_to_a_size_the_luks_sector_size_does_not_divide_is_refused_up_front(
    salt_functions, host, monkeypatch, dry_run
):
    """The formula formats LUKS2 with 4096-byte sectors (defaults.yaml luks.sector_size). A SAN
    LUN grown by a size in 512-byte blocks (many arrays take a block count) to 2 GiB + 512: the
    LUKS device would have to span 2 GiB - 16 MiB + 512 bytes, and cryptsetup resize refuses
    ("Device size is not aligned to requested sector size.", crypt_resize's MISALIGNED check). The
    plan does not know the crypt segment's sector_size (dm_tables has it), so test mode says
    "would grow ... cryptsetup resize ... pvresize" and the apply runs multipathd resize, then
    fails at cryptsetup, on every apply. test=True should say what the apply would do: refuse,
    naming the sector size, before any command."""
    stack = Stack({"sdb": 2 * GIB + 512, "sdc": 2 * GIB + 512}, GIB, 251)
    on_stack(salt_functions, host, monkeypatch, stack)
    ret = lun_grown(stack)
    assert ret["result"] is False and "sector" in ret["comment"], ret
    assert not stack.ran


# ---- 6. a pv argument that is not the crypt mapping it is named after ------------------------------


def test_a_pv_path_that_is_not_the_crypt_mapping_of_the_device_is_refused(salt_functions, host, monkeypatch):
    """lun_growth checks that the dm device *named* basename(pv) is a crypt mapping of the
    pillar's device, then looks the PV up by realpath(pv): two different devices when the path
    is not /dev/mapper/<that name>. Here pv is /dev/disk/by-label/hana_log_0, a link that leads
    to /dev/sdz, a PV of another VG (vg_sap, 100 extents on 1 GiB). The crypt mapping hana_log_0
    on mpatha checks out (already at size), the PV facts are sdz's, and the plan's "pv" step
    compares sdz's extents with the size of the LUKS device: lun_grown runs ``pvresize
    /dev/disk/by-label/hana_log_0`` -- a write to a PV of vg_sap, a device the pillar never
    named. lvm.sls renders /dev/mapper/<crypt name>, so this needs a state called by hand (or a
    site's own SLS); the state is public all the same, and the guard's promise is that only
    devices the pillar allows are written. The PV must be the crypt mapping itself (its
    major:minor that of the dm device hana_log_0)."""
    stack = Stack({"sdb": 2 * GIB, "sdc": 2 * GIB}, 2 * GIB, 507)
    alias = "/dev/disk/by-label/hana_log_0"
    stack.links[alias] = "/dev/sdz"
    stack.others[alias] = ("sdz", "vg_sap", 100, GIB)
    on_stack(salt_functions, host, monkeypatch, stack)
    ret = states.lun_grown(MPATH, alias, KEY)
    assert not [argv for argv in stack.ran if argv[0] == "pvresize"], (stack.ran, ret)
    assert ret["result"] is False, ret
