"""Attacks on the fixes of tests/unit/test_attack5_growth.py (commit 4d68880): the XFS geometry
ioctl, the facts' size override, fs_grown, the `unless`-guarded core LVM steps and test mode's
estimates. Each test states what should hold and fails while the hole is open; the docstrings
name the scenario."""

# ruff: noqa: F811 - the fixtures imported from test_states are parameters of the tests

import errno
import importlib.util
import os
import platform
import struct
import sys

import pytest
from salt.exceptions import CommandExecutionError

from tests.conftest import REPO
from tests.unit.test_attack5_growth import lv_steps, step_args
from tests.unit.test_growth import BUILT, MIB4, pvs
from tests.unit.test_sls import rendered
from tests.unit.test_states import (  # noqa: F401  (fixtures: pytest finds them by name here)
    argvs_run,
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

GIB = 1 << 30
DEV = "253:4"
LOG_LV = "/dev/vg_hana_log/lv_hana_log"
# _IOR('X', 100, struct xfs_fsop_geom_v1) as a powerpc kernel spells it: <asm/ioctl.h> there has
# 13 size bits and 3 direction bits from bit 29, _IOC_READ = 2 (the formula's 0x80705864 is the
# generic layout of x86_64, aarch64, s390x)
POWER_GEOMETRY_IOCTL = 0x40705864


def load_host():
    spec = importlib.util.spec_from_file_location(
        "host_module_attack6", REPO / "_modules" / "hana_storage_host.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def geometry_kernel(accepts, data_bytes, calls=None):
    """An fcntl whose ioctl answers XFS_IOC_FSGEOMETRY_V1 (blocksize 4096, ``data_bytes``) only
    when asked with the request number ``accepts`` (None: any); anything else is ENOTTY, as a
    kernel answers an ioctl number it does not know. ``calls``: the (fd, request) of each call."""

    class Kernel:
        @staticmethod
        def ioctl(fd, request, buf, mutate=True):
            if calls is not None:
                calls.append((fd, request))
            if accepts is not None and request != accepts:
                raise OSError(errno.ENOTTY, os.strerror(errno.ENOTTY))
            struct.pack_into("=I", buf, 0, 4096)
            struct.pack_into("=Q", buf, 32, data_bytes // 4096)
            return 0

    return Kernel


def xfs_info_runner(data_bytes):
    """cmd.run_all answering xfs_info / xfs_growfs -n as xfsprogs does (for a fix that reads the
    geometry through them instead of the ioctl)."""
    geometry = f"data     =                       bsize=4096   blocks={data_bytes // 4096}, imaxpct=25\n"

    def run_all(argv, **kwargs):
        if argv[0] in ("xfs_info", "xfs_growfs", "xfs_spaceman"):
            return {"retcode": 0, "stdout": geometry, "stderr": ""}
        return {"retcode": 1, "stdout": "", "stderr": f"{argv[0]}: not expected here"}

    return run_all


# ---- 1. the geometry ioctl's number is x86's: on POWER (the README's seed) it is ENOTTY -----------


@pytest.fixture
def power_host(monkeypatch):
    """The host module loaded as on a ppc64le minion (SLES for SAP on Power10: the seed's layout,
    README "Multipath SAN LUNs"); the formula's package is imported afresh, so a request number
    derived from the architecture at import is derived for this one."""
    uname = os.uname()
    monkeypatch.setattr(
        os,
        "uname",
        lambda: os.uname_result((uname.sysname, uname.nodename, uname.release, uname.version, "ppc64le")),
    )
    monkeypatch.setattr(platform, "machine", lambda: "ppc64le")
    for name in [n for n in sys.modules if n == "hana_storage_core" or n.startswith("hana_storage_core.")]:
        monkeypatch.delitem(sys.modules, name)
    module = load_host()
    monkeypatch.setattr(module, "fcntl", geometry_kernel(POWER_GEOMETRY_IOCTL, GIB), raising=False)
    module.__salt__ = {"cmd.run_all": xfs_info_runner(GIB)}
    module.__context__ = {}
    return module


def test_the_mounted_xfss_size_is_read_on_power_too(power_host, tmp_path):
    """XFS_IOC_FSGEOMETRY_V1 is hard-coded as 0x80705864, the generic _IOC layout. powerpc
    (also mips, sparc) encodes _IOR with the direction in bits 29-31: 0x40705864. The XFS on a
    ppc64le host answers the formula's number with ENOTTY, so fs_grown raises on every apply
    (mount.sls runs it for every volume, growth or not) and the audit's override is suppressed:
    the stale superblock read (attack 5, hole 1) is back on POWER."""
    try:
        data_bytes = power_host.mounted_xfs_bytes(str(tmp_path))
    except CommandExecutionError as error:
        pytest.fail(f"the geometry of a mounted XFS is not read on ppc64le: {error}")
    assert data_bytes == GIB


# ---- 2. fs_grown raises instead of failing ------------------------------------------------------


def dev_of_directory(path):
    """The ``major:minor`` of the filesystem a directory is on (its st_dev)."""
    st_dev = os.stat(path).st_dev
    return f"{os.major(st_dev)}:{os.minor(st_dev)}"


def mount_log(monkeypatch, mountpoint, dev):
    """The mount table says the LV (``dev``) is mounted at ``mountpoint``, a real directory."""
    os.makedirs(mountpoint, exist_ok=True)
    monkeypatch.setattr(states, "_live_mount", lambda path: {"dev": dev} if path == str(mountpoint) else None)
    real_dev_of, real_exists = states._dev_of, os.path.exists
    monkeypatch.setattr(states, "_dev_of", lambda path: dev if path == LOG_LV else real_dev_of(path))
    monkeypatch.setattr(states.os.path, "exists", lambda path: path == LOG_LV or real_exists(path))
    return str(mountpoint)


def test_fs_grown_fails_with_a_message_when_the_geometry_cannot_be_read(
    salt_functions, monkeypatch, tmp_path
):
    """mounted_xfs_bytes raises CommandExecutionError (ENOTTY on POWER, see 1; ENOENT or EACCES
    when the path does not lead to the mount, see 3). fs_grown does not catch it: Salt turns it
    into 'An exception occurred in this state: Traceback ...' on every apply, where every other
    state of the formula answers result False with a sentence."""

    def unreadable(mountpoint, *args, **kwargs):
        raise CommandExecutionError(f"{mountpoint}: XFS geometry not read: Inappropriate ioctl for device")

    # the path leads to the mount the table names: only the ioctl fails
    mountpoint = mount_log(monkeypatch, tmp_path / "log", dev_of_directory(tmp_path))
    salt_functions["hana_storage_host.mounted_xfs_bytes"] = unreadable
    salt_functions["hana_storage_host.block_bytes"] = lambda path: 2 * GIB
    try:
        ret = states.fs_grown(mountpoint, LOG_LV)
    except CommandExecutionError as error:
        pytest.fail(f"fs_grown raised (a traceback in the state's comment): {error}")
    assert ret["result"] is False and "geometry" in ret["comment"], ret
    assert argvs_run(salt_functions) == []


# ---- 3. the mountpoint's path leads to another filesystem than the mount table's entry ----------


def test_fs_grown_grows_no_filesystem_but_the_one_it_checked(salt_functions, monkeypatch, tmp_path):
    """/hana is mounted again over a live /hana/data (a cluster resource, an admin's `mount
    /hana`): /proc/self/mountinfo still lists /hana/data from the LV (its entry is only hidden),
    so _live_mount says 'ours'; but the path /hana/data now leads to the directory data/ of the
    /hana XFS. The ioctl and `xfs_growfs -d /hana/data` both go by the path: fs_grown sizes the
    /hana XFS (1 GiB) against the LV (2 GiB) and runs xfs_growfs on /hana, irreversibly, from
    the highstate or from HANA-LAYOUT-009's automatic remediation. The path is a directory of
    this test's filesystem, whose st_dev is not the LV's: the state must see that (os.stat(name)
    .st_dev, as _io_check_file does) before it reads or grows anything."""
    mountpoint = mount_log(monkeypatch, tmp_path / "data", DEV)  # the table's entry: the LV, DEV
    salt_functions["hana_storage_host.mounted_xfs_bytes"] = lambda path, *args, **kwargs: GIB  # /hana's XFS
    salt_functions["hana_storage_host.block_bytes"] = lambda path: 2 * GIB
    ret = states.fs_grown(mountpoint, LOG_LV)
    assert ["xfs_growfs", "-d", mountpoint] not in argvs_run(salt_functions), ret
    assert ret["result"] is False, ret


@pytest.fixture
def host(monkeypatch):
    """The host module with facts() fed one LV (dm-4, DEV) mounted as XFS at the plan's
    mountpoint; everything facts() reads besides the superblocks is stubbed empty."""
    module = load_host()
    module.__salt__, module.__context__ = {}, {}
    device = {
        "kind": "lv",
        "dev": DEV,
        "dm_name": "vg_hana_log-lv_hana_log",
        "suspended": False,
        "slaves": [],
    }
    module.tree = {"dm-4": {**device, "path": "/dev/dm-4", "holders": [], "mountpoints": []}}
    module.mounts = []
    monkeypatch.setattr(module, "_device_tree", lambda: (module.tree, module.mounts))
    monkeypatch.setattr(
        module, "_superblock_of", lambda name: {"uuid": "u", "blocksize": 4096, "data_bytes": 2 * GIB}
    )
    for name, value in {
        "_closed_headers": {},
        "_header_backup_facts": {},
        "_previous_key_facts": {},
        "_backup_keyslot_facts": {},
        "_lvm_scans_for": [],
        "_lvm_segments": [],
        "_parsed_file": [],
        "_key_file_facts": {},
        "_device_names": {},
        "_crypto_drivers": {},
    }.items():
        monkeypatch.setattr(module, name, lambda *args, value=value, **kwargs: value)
    return module


def log_plan(mountpoint):
    volume = {"mountpoint": mountpoint, "fs_dm_name": "vg_hana_log-lv_hana_log", "devices": [], "crypt": []}
    return {"volumes": {"log": volume}}


def mounted_at(mountpoint):
    return {
        "dev": DEV,
        "mountpoint": mountpoint,
        "fstype": "xfs",
        "source": LOG_LV,
        "options": [],
        "root": "/",
    }


def test_the_audit_takes_no_size_from_a_filesystem_the_path_leads_to_instead(host, monkeypatch, tmp_path):
    """The same hidden mount, as the audit sees it: facts() overrides the LV's data_bytes with
    the ioctl's answer for whatever the path /hana/data leads to (here: this test's filesystem,
    whose XFS says 1 GiB). HANA-LAYOUT-009 then fires on a 2 GiB XFS that fills its 2 GiB LV,
    and its automatic fix is the xfs_growfs of 3. Only an answer from the mount's own device
    (fstat(fd).st_dev == the mount's dev) may replace the superblock's figure."""
    mountpoint = str(tmp_path)
    host.mounts.append(mounted_at(mountpoint))
    monkeypatch.setattr(host, "fcntl", geometry_kernel(None, GIB), raising=False)
    facts = host.facts(log_plan(mountpoint))
    assert facts["superblocks"]["dm-4"]["data_bytes"] == 2 * GIB


def test_a_mountpoint_path_that_leads_nowhere_does_not_crash_the_audit(host, monkeypatch, tmp_path):
    """/hana covered by a tmpfs (or any mount without data/): the mount table lists /hana/data,
    the path does not exist. mounted_xfs_bytes calls os.open outside its try, so the OSError
    (FileNotFoundError) escapes; facts() suppresses only CommandExecutionError: the whole audit
    (beacon, remediate, report) ends in a traceback instead of a finding."""
    mountpoint = str(tmp_path / "data")  # not there: the path leads into the covering mount
    host.mounts.append(mounted_at(mountpoint))
    monkeypatch.setattr(host, "fcntl", geometry_kernel(None, GIB), raising=False)
    try:
        facts = host.facts(log_plan(mountpoint))
    except OSError as error:
        pytest.fail(f"the audit's facts raised: {error!r}")
    assert facts["superblocks"]["dm-4"]["data_bytes"] == 2 * GIB


# ---- 4. test mode's PV estimate turns an apply that grows into a refusal ------------------------


def test_test_mode_does_not_refuse_a_growth_the_apply_makes(salt_functions, opts):
    """Above LVM the new PVs are the raw LUNs: no LUKS2 header under them, only pvcreate's
    1 MiB pe_start. lv_extended's estimate still takes 17 MiB off each (PV_OVERHEAD_BYTES):
    a 1 GiB LUN is 251 extents of 4 MiB in test mode, 255 in the apply. size 2840M on an
    800 MiB 2-stripe LV needs 510 extents: the apply grows it onto c and d; test=True answers
    result False 'not growing ... Nothing was changed' (its VG 'has room for' 502)."""
    devices = ["/dev/a", "/dev/b", "/dev/c", "/dev/d"]  # lvm.sls: pvs == devices above LVM
    salt_functions["hana_storage_host.block_bytes"] = lambda path: GIB
    # the apply, after pv-2/pv-3 and vg-extended: pvcreate made c, d 255 extents each
    salt_functions["hana_storage_host.lv_room"] = lambda name: {
        "segments": BUILT,
        "pvs": pvs(a=0, b=0, c=255, d=255),
    }
    applied = states.lv_extended(LOG_LV, 2, 64, "2840M", pvs=devices, devices=devices)
    assert applied["result"] is True and applied["changes"]["extended"]["new"] == 2840 << 20, applied
    # test=True before those steps: c, d are no PVs yet
    opts["test"] = True
    salt_functions["cmd.run_all"].reset_mock()
    salt_functions["hana_storage_host.lv_room"] = lambda name: {"segments": BUILT, "pvs": pvs(a=0, b=0)}
    ret = states.lv_extended(LOG_LV, 2, 64, "2840M", pvs=devices, devices=devices)
    assert ret["result"] is None, ret["comment"]
    assert argvs_run(salt_functions) == []


# ---- 5. test=True does not list the resize and the growfs it promises --------------------------


def test_test_mode_names_every_command_of_a_growth(tmp_path, salt_functions, dry_run, monkeypatch):
    """README, 'Growing a volume': 'test=True lists each command.' Above LVM with two new LUNs,
    test=True shows lvextend (lv-extended, result None), but crypt-grown answers 'hana_data
    spans all of ...' and fs-grown 'the XFS at /hana/data fills ...', both result True: the
    cryptsetup resize and xfs_growfs the apply runs are not named anywhere, and the two steps
    read as compliant. The states run with the rendered SLS's arguments (and Salt's
    __running__ of the steps before them), so a fix may take either route."""
    devices = ["/dev/a", "/dev/b", "/dev/c", "/dev/d"]
    data = str(tmp_path / "hana-data")  # the mountpoint: a real directory, the mount's root
    os.makedirs(data)
    storage = {"volumes": {"data": {"mountpoint": data, "devices": devices, "stripes": 2, "stripe_size": 64}}}
    lv = step_args(
        rendered(tmp_path, storage, "lvm.sls")["hana-storage-data-lv-extended"]["hana_storage.lv_extended"]
    )
    crypt = step_args(
        rendered(tmp_path, storage, "luks.sls")["hana-storage-data-crypt-grown"]["hana_storage.crypt_grown"]
    )
    fs = step_args(
        rendered(tmp_path, storage, "mount.sls")["hana-storage-data-fs-grown"]["hana_storage.fs_grown"]
    )
    lv_bytes, offset = 200 * MIB4, 32768  # the LV today; LUKS2 data offset in sectors
    sizes = {lv["name"]: lv_bytes, fs["device"]: lv_bytes - offset * 512}
    salt_functions["hana_storage_host.block_bytes"] = lambda path: sizes.get(path, GIB)
    segment = {**BUILT[0], "lv": "lv_hana_data", "vg": "vg_hana_data"}
    salt_functions["hana_storage_host.lv_room"] = lambda name: {"segments": [segment], "pvs": pvs(a=0, b=0)}
    table = [
        {"target": "crypt", "device": DEV, "offset": offset, "start": 0, "length": lv_bytes // 512 - offset}
    ]
    salt_functions["hana_storage_host.dm_tables"].return_value = {crypt["name"]: table}
    salt_functions["hana_storage_host.mounted_xfs_bytes"] = lambda path, *args, **kwargs: (
        lv_bytes - offset * 512
    )
    monkeypatch.setattr(states, "_same_device", lambda table_device, path: True)
    monkeypatch.setattr(states, "_live_mount", lambda mountpoint: {"dev": dev_of_directory(data)})
    monkeypatch.setattr(states, "_dev_of", lambda path: dev_of_directory(data))
    real_exists = os.path.exists
    monkeypatch.setattr(states.os.path, "exists", lambda path: path.startswith("/dev/") or real_exists(path))
    comments = []
    running = {}
    monkeypatch.setattr(states, "__running__", running, raising=False)
    for state_id, function, kwargs in [
        ("hana-storage-data-lv-extended", states.lv_extended, lv),
        ("hana-storage-data-crypt-grown", states.crypt_grown, crypt),
        ("hana-storage-data-fs-grown", states.fs_grown, fs),
    ]:
        ret = function(**kwargs)
        running[f"hana_storage_|-{state_id}_|-{kwargs['name']}_|-x"] = {**ret, "__id__": state_id}
        comments.append(ret["comment"])
    assert "lvextend" in comments[0], comments
    said = " ".join(comments)
    assert "cryptsetup resize" in said and "xfs_growfs" in said, comments


# ---- 6. a VG name YAML reads as a number is another VG -------------------------------------------


def test_the_vg_steps_name_the_pillars_vg_as_written(tmp_path):
    """lvm_name allows '0100' (or '1.10', '1_000', 'on'). lvm.sls renders `- name: {{ volume.vg
    }}` unquoted: YAML reads 0100 as the integer 100, so the new vg_extended extends the VG
    '100' (another VG, if there is one) while `unless: vgs 0100` looks at the pillar's; core
    vg_present and lv_present get the same number. pvs/devices are rendered with |json already."""
    steps = lv_steps(tmp_path, {"devices": ["/dev/mapper/mpatha"], "vg": "0100"})
    names = {
        "vg_extended": step_args(steps["hana-storage-data-vg-extended"]["hana_storage.vg_extended"])["name"],
        "vg_present": step_args(steps["hana-storage-data-vg"]["hana_storage.vg_present"])["name"],
        "lv_present": step_args(steps["hana-storage-data-lv"]["hana_storage.lv_present"])["name"].split("/")[
            2
        ],
    }
    assert names == dict.fromkeys(names, "0100")
