"""What is on this host, read-only: the facts the audit, the states and the guard work from.

sysfs, one `dmsetup table`, one `lvs`, the mount table, LUKS headers and XFS superblocks read
straight from the devices, and the data-loss guard's ``probe``. Nothing here writes to a device
or calls a state: the formula's states read the host through this module, and
``hana_storage.remediate`` (which runs states) is elsewhere. Parsing is in
the package ``hana_storage_core``; the stable interface is ``hana_storage``'s, whose ``dm_tables``,
``luks_header``, ``xfs_superblock``, ``inspect`` and ``probe`` are these.
"""

import contextlib
import datetime
import fcntl
import itertools
import json
import logging
import os
import platform
import re
import signal
import stat
import subprocess
import time

import hana_storage_core as core  # the loader puts its utils directories on sys.path while loading this
import salt.utils.args
import salt.utils.path
import salt.utils.platform
from salt.exceptions import CommandExecutionError

core = core.fresh()  # after a saltutil.sync, the files it brought, not those this process imported first

log = logging.getLogger(__name__)

__virtualname__ = "hana_storage_host"

SYSTEM_MOUNTS = ("/", "/boot", "/boot/efi", "/usr", "/var")
SYSFS_BLOCK = "/sys/class/block"
# the device-mapper driver's misc device: present once the kernel has device-mapper
DM_DRIVER = "/sys/class/misc/device-mapper"
FIPS_ENABLED = "/proc/sys/crypto/fips_enabled"
LVM_REPORT = "hana_storage_host.lvm_report"  # __context__: (lvm.report_key, segments)
# Kernel names that can change across boots: a pillar should name the LUN, not the path
UNSTABLE_NAME = re.compile(r"^/dev/(sd[a-z]+|vd[a-z]+|xvd[a-z]+|hd[a-z]+|nvme[0-9]+n[0-9]+)$")
BY_ID = "/dev/disk/by-id"
# by-id links named after the hardware (WWN, serial): stable names for a disk. Others there name
# what is on it (lvm-pv-uuid-, dm-uuid-, md-uuid-) and change when it is formatted.
BY_ID_HARDWARE = ("wwn-", "scsi-", "nvme-", "virtio-", "ata-", "usb-", "mmc-", "cciss-", "google-")
# Devices whose first bytes are never read: optical drives, floppies, RAM disks.
UNREAD_DEVICE_PREFIXES = ("sr", "fd", "ram", "zram")
HEADER_PROBE = 4096
# Where the guard looks for data on a device without a signature (see _first_data)
HEAD_BYTES = 8 << 20
SAMPLE_BYTES = 1 << 20
SPREAD_WINDOWS, SPREAD_BYTES = 64, 64 << 10
BLKID_NOTHING, BLKID_AMBIVALENT = 2, 8


def __virtual__():
    if not salt.utils.platform.is_linux():
        return False, "hana_storage_host: only Linux has dm-crypt, LVM and XFS"
    if not salt.utils.path.which("dmsetup"):
        return False, "hana_storage_host: dmsetup not found (install the dmsetup or device-mapper package)"
    return __virtualname__


# ---- facts from the host ---------------------------------------------------------------------


def device_facts(devices):
    """{path: {"exists", "block", "realpath"}} for the pillar's host checks."""
    facts = {}
    for device in devices:
        try:
            mode = os.stat(device).st_mode
            facts[device] = {
                "exists": True,
                "block": stat.S_ISBLK(mode),
                "realpath": f"/dev/{_kernel_name(device)}",
            }
        except OSError:
            facts[device] = {"exists": False}
    return facts


def mounted_xfs_bytes(mountpoint, dev=None):
    """The data section of the XFS mounted at ``mountpoint``, in bytes, as the filesystem has it
    now (its geometry ioctl; the superblock read through the block device lags it). ``dev``: the
    mount's ``major:minor`` in the mount table; the path must lead to that filesystem (a mount
    over a parent directory hides the entry the table still lists)."""
    try:
        fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        raise CommandExecutionError(f"{mountpoint}: XFS geometry not read: {error.strerror}") from None
    try:
        found = os.fstat(fd).st_dev
        if dev is not None and f"{os.major(found)}:{os.minor(found)}" != dev:
            raise CommandExecutionError(
                f"{mountpoint}: XFS geometry not read: the path leads to device "
                f"{os.major(found)}:{os.minor(found)}, not the mounted {dev} (another mount hides it)"
            )
        raw = bytearray(core.xfs.GEOMETRY_SIZE)
        fcntl.ioctl(fd, core.xfs.geometry_ioctl(platform.machine()), raw, True)
        return core.xfs.parse_geometry(raw)["data_bytes"]
    except OSError as error:
        raise CommandExecutionError(f"{mountpoint}: XFS geometry not read: {error.strerror}") from None
    except core.xfs.XfsError as error:
        raise CommandExecutionError(f"{mountpoint}: XFS geometry not read: {error}") from None
    finally:
        os.close(fd)


def block_bytes(path):
    """The size of the block device at ``path`` in bytes (sysfs), or None if it has none."""
    return _sysfs_bytes(_kernel_name(path))


def _sysfs_bytes(name):
    size = _read(f"{SYSFS_BLOCK}/{name}/size").strip()
    return int(size) * 512 if size.isascii() and size.isdigit() else None


def lv_geometry(lv_paths):
    """{lv path: {"stripes", "stripe_size", "pvs"}} of those of ``lv_paths`` that exist: the
    stripes of the first segment (the LV's own geometry) and how many PVs its segments span."""
    wanted = {tuple(path.split("/")[2:4]): path for path in lv_paths if path.count("/") == 3}
    if not wanted:
        return {}
    segments = _kept("lvs", _read_lvm_segments)
    if not isinstance(segments, list):
        return {}  # no LVM here: nothing to grow
    found = {}
    for segment in segments:
        path = wanted.get((segment["vg"], segment["lv"]))
        if path is None:
            continue
        entry = found.setdefault(
            path, {"stripes": segment["stripes"], "stripe_size": segment["stripe_size"], "pvs": set()}
        )
        entry["pvs"].update(segment["devices"])
    return {path: {**entry, "pvs": len(entry["pvs"])} for path, entry in found.items()}


def dm_suspended(path):
    """Whether the device-mapper device at ``path`` is suspended now (a multipath map while
    multipathd reloads it, a crypt mapping during a resize); False for any other device."""
    return _read(f"{SYSFS_BLOCK}/{_kernel_name(path)}/dm/suspended").strip() == "1"


def _kept(kind, read):
    """``read()``: a report of ``kind`` ("pvs", "lvs", "dm"), or the one this state run read already
    and kept (lvm.RUN_REPORTS: each PV, VG and LV step of every volume asks the same, and on a
    host with many LUNs each report scans all of them). An error is never kept. A kept report
    may only tell a step that it has nothing to do: what a step acts on it reads afresh (the
    states' _afresh), and the guard always does (_pv_groups)."""
    kept = _run_reports()
    if kept is None:  # not in a state run
        return read()
    if kind not in kept:
        found = read()
        if isinstance(found, dict) and "error" in found:
            return found
        kept[kind] = found
    return kept[kind]


def _run_reports():
    """The reports this state run keeps (lvm.RUN_REPORTS), or None outside a state run."""
    return globals().get("__context__", {}).get(core.lvm.RUN_REPORTS)


def _keep(kind, found):
    """A report just read, kept for the rest of the state run in place of an older one."""
    kept = _run_reports()
    if kept is not None and isinstance(found, list):
        kept[kind] = found


def _read_pv_room():
    """Every PV with its VG and extents (one `pvs`), or {"error": ...}. A PV on a suspended
    device is left out (its reads would block)."""
    if not salt.utils.path.which("pvs"):
        return {"error": "pvs not found (lvm2 not installed)"}
    text, error = _run(core.lvm.pv_room_command())
    if error:
        return {"error": error}
    try:
        return core.lvm.parse_pv_room(text)
    except ValueError as err:
        return {"error": str(err)}


def _pv_room(vg=None):
    """The PVs (of ``vg``, or all) from the run's kept `pvs`: a list, or {"error": ...}."""
    pvs = _kept("pvs", _read_pv_room)
    if not isinstance(pvs, list):
        return pvs
    return [p for p in pvs if vg is None or p["vg"] == vg]


def pv_names():
    """{"pvs": [the device of every PV, as `pvs` names it]} or {"error": ...}: for
    hana_storage.pv_present. A PV on a suspended device is left out (its reads would block)."""
    pvs = _pv_room()
    return {"pvs": [p["pv"] for p in pvs]} if isinstance(pvs, list) else pvs


def vg_pvs(vg):
    """{"pvs": [the PVs of ``vg``]} or {"error": ...}: for hana_storage.vg_extended."""
    pvs = _pv_room(vg)
    return {"pvs": [p["pv"] for p in pvs]} if isinstance(pvs, list) else pvs


def lv_segments(lv_path):
    """{"segments": [the segments of the LV /dev/<vg>/<lv>]} (none: no such LV) or {"error": ...}."""
    vg, lv = lv_path.split("/")[2:4]
    segments = _kept("lvs", _read_lvm_segments)
    if not isinstance(segments, list):
        return segments
    return {"segments": [s for s in segments if (s["vg"], s["lv"]) == (vg, lv)]}


def lv_room(lv_path):
    """The LV's segments and its VG's PVs with their free extents, for hana_storage.lv_extended:
    {"segments": [...], "pvs": [...]} or {"error": ...}."""
    found = lv_segments(lv_path)
    if "error" in found:
        return found
    pvs = _pv_room(lv_path.split("/")[2])
    return {**found, "pvs": pvs} if isinstance(pvs, list) else pvs


def lun_growth(device, pv):
    """What carries the size of the pillar's ``device`` (a LUN grown in place) up to its PV
    ``pv`` (the device itself above LVM, the open LUKS device on it below): lun.plan over
    facts read now (sysfs, the dm table below LVM, the run's kept `pvs`), with "map": the dm
    name of a multipath map ("" for another device). {"error": ...} where it cannot grow."""
    name = _kernel_name(device)
    # a failed path may report no size (0): lun.plan tells it apart from a path that disagrees
    paths = {path: _sysfs_bytes(path) or 0 for path in _multipath_paths(name)}
    facts = {"device": device, "device_bytes": block_bytes(device), "paths": paths, "crypt": None, "pv": None}
    if os.path.realpath(pv) != os.path.realpath(device):  # below LVM
        crypt = os.path.basename(pv)
        tables = _kept("dm", _read_dm_tables)
        if "error" in tables:
            return tables
        table = tables["tables"].get(crypt) or []
        segment = next((s for s in table if s["target"] == "crypt"), None)
        if (
            segment is None
            or segment["device"] not in {_dev_of(device), device, os.path.realpath(device)}
            or _read(f"{SYSFS_BLOCK}/{_kernel_name(pv)}/dm/name").strip() != crypt  # pv is that mapping
        ):
            return {"error": f"{pv} is not an open crypt mapping of {device}"}
        facts["crypt"] = {
            "name": crypt,
            "bytes": sum(s["length"] for s in table) * 512,
            "offset_bytes": segment["offset"] * 512,
            "sector_bytes": segment.get("sector_size") or 512,
        }
    pvs = _pv_room()
    if not isinstance(pvs, list):
        return pvs
    facts["pv"] = next((p for p in pvs if os.path.realpath(p["pv"]) == os.path.realpath(pv)), None)
    if facts["pv"] is None and dm_suspended(pv):  # `pvs` leaves out a suspended device: unknown, not "no PV"
        return {"error": f"{pv} is suspended (multipathd reloading?), so `pvs` left it out: run again"}
    try:
        found = core.lun.plan(facts)
    except core.lun.LunError as error:
        return {"error": str(error)}
    return {**found, "map": _read(f"{SYSFS_BLOCK}/{name}/dm/name").strip() if paths else ""}


def _read_dm_tables():
    """{"tables": dm_tables()} or {"error": ...}, for _kept."""
    try:
        return {"tables": dm_tables()}
    except CommandExecutionError as error:
        return {"error": str(error)}


def _dev_of(path):
    """``major:minor`` of the block device at ``path``, or None."""
    try:
        rdev = os.stat(path).st_rdev
    except OSError:
        return None
    return f"{os.major(rdev)}:{os.minor(rdev)}"


def path_facts(paths):
    """{path: {"realpath", "fstype"}}: where a directory the pillar names really leads (the part
    that exists resolved, the rest appended) and the type of the file system it lands on."""
    mounts = sorted(_mounts(), key=lambda m: len(m["mountpoint"]))
    facts = {}
    for path in paths:
        if not path.startswith("/"):
            continue
        real = os.path.realpath(path)
        under = [
            m for m in mounts if real == m["mountpoint"] or real.startswith(m["mountpoint"].rstrip("/") + "/")
        ]
        facts[path] = {"realpath": real, "fstype": under[-1]["fstype"] if under else None}
    return facts


def system_devices():
    """Device paths that hold the running system (/, /boot, /usr, /var, swap), disks included."""
    devices = core.stack.build_devices(_sysfs(), {}, _mounts())
    tops = {n for n, d in devices.items() if set(d["mountpoints"]) & set(SYSTEM_MOUNTS)}
    for line in _read("/proc/swaps").splitlines()[1:]:
        path = line.split()[0] if line.split() else ""
        name = _kernel_name(path)
        if path.startswith("/dev/") and name in devices:
            tops.add(name)
    names = set()
    for top in tops:
        for name in core.stack.stack(devices, top):
            names.add(name)
            parent = devices[name]["partition_of"]
            if parent:
                names.add(parent)
    return sorted(f"/dev/{name}" for name in names)


def boot_facts():
    """What a boot opens its LUKS devices with: ``memory``, the host's RAM (``/proc/meminfo``'s
    MemTotal; cryptsetup counts sysconf's physical pages, the same outside a container),
    ``crypttab``, the lines systemd opens (core.tab), and ``fips``, whether the kernel runs in
    FIPS mode (cryptsetup then opens PBKDF2 keyslots only)."""
    memory = {"error": "/proc/meminfo: no MemTotal line"}
    for line in _read("/proc/meminfo").splitlines():
        fields = line.split()
        if fields[:1] == ["MemTotal:"] and len(fields) >= 2 and fields[1].isdigit():
            memory = {"total_kib": int(fields[1])}
    return {
        "memory": memory,
        "crypttab": _parsed_file("/etc/crypttab", core.tab.parse_crypttab),
        # a kernel built without FIPS support has no such file: not in FIPS mode
        "fips": _read(FIPS_ENABLED).strip() == "1",
    }


# seconds the readiness check gives Clevis per keyslot by default (a boot's password agent waits
# about as long for Tang), and how many such waits all the lines together get, so that a Tang
# server that accepts and never answers costs a few waits, not one per line
CLEVIS_TIMEOUT = 30
CLEVIS_WAITS = 4
# seconds a state waits for Clevis to prove a binding (clevis_opens, tpm2_unseals): its answer
# decides what is kept and what removed, and a slow TPM (a vTPM on a busy host) is no failure
PROOF_TIMEOUT = 120
# where systemd-cryptsetup looks for a key when crypttab's key field is none or "-" (systemd 247+)
KEY_DIRECTORIES = ("/etc/cryptsetup-keys.d", "/run/cryptsetup-keys.d")
# what Clevis runs in: no proxy and no shell options of the minion's (the boot's agent has neither)
CLEVIS_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}


def boot_path(clevis_timeout=CLEVIS_TIMEOUT):
    """
    What the boot path would meet for each /etc/crypttab line, read now (the facts of
    ``hana_storage.boot_readiness``; core.readiness judges them): ``{"lines": [...], "facts":
    [...]}``, or ``{"error": ...}`` when /etc/crypttab cannot be read.

    Reads only: a key file, and what Clevis decrypts for a keyslot, are each tried on an
    in-memory copy of the header (``clevis luks pass``, the boot agent's own way to pick and
    decrypt a keyslot's token, pipes the passphrase into ``cryptsetup open --test-passphrase``,
    never through Salt). Clevis asks the Tang servers (or
    the TPM) as the boot will, so this contacts them, unlike the audit: at most
    ``clevis_timeout`` seconds a keyslot and ``CLEVIS_WAITS`` times that in all.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage_host.boot_path
    """
    try:
        timeout = 0 if isinstance(clevis_timeout, bool) else float(clevis_timeout)
    except (TypeError, ValueError):
        timeout = 0
    if not 1 <= timeout <= 3600:
        raise CommandExecutionError(f"clevis_timeout is seconds, 1 to 3600, not {clevis_timeout!r}")
    lines = _parsed_file("/etc/crypttab", core.tab.parse_crypttab)
    if not isinstance(lines, list):
        return {"error": lines.get("error", "/etc/crypttab unreadable")}
    units = {unit: unit_enabled(unit) for unit in core.readiness.ASKPASS_UNITS}
    deadline = time.monotonic() + CLEVIS_WAITS * timeout
    facts = []
    for line in lines:
        source = _crypttab_source_path(line["device"])
        fact = {"source": source, "units": units}
        if source and core.readiness.judged_by_key(line):
            key_file = (
                line["keyfile"] if core.readiness.has_key_file(line) else _key_in_directories(line["name"])
            )
            if not key_file:
                fact["clevis"] = _clevis_unlocks(source, _header_or_error(source), timeout, deadline)
            elif os.path.isfile(key_file):
                fact["key"] = {"path": key_file, "exists": True, **key_opens(source, key_file)}
            else:
                fact["key"] = {"path": key_file, "exists": False}
        facts.append(fact)
    return {"lines": lines, "facts": facts}


def _key_in_directories(name):
    """The key file systemd-cryptsetup finds for ``name`` when crypttab gives none, if any."""
    for directory in KEY_DIRECTORIES:
        path = os.path.join(directory, f"{name}.key")
        if os.path.isfile(path):
            return path
    return None


def _crypttab_source_path(device):
    """The path systemd opens for crypttab's device field, if that device is there now. A tag
    (``UUID=``...) is a /dev/disk link udev makes; only a host without udev (the lab's guest)
    asks blkid instead (without its cache file: this reads only)."""
    tags = {
        "UUID=": "by-uuid",
        "PARTUUID=": "by-partuuid",
        "LABEL=": "by-label",
        "PARTLABEL=": "by-partlabel",
    }
    try:
        for tag, folder in tags.items():
            if device.startswith(tag):
                link = f"/dev/disk/{folder}/{device[len(tag) :]}"
                if os.path.exists(link):
                    return os.path.realpath(link)
                if os.path.exists("/run/udev/control"):
                    return None  # udev runs and made no link: systemd would wait for it in vain
                found, error = _run(["blkid", "-c", "/dev/null", "-o", "device", "-t", device])
                return (found.split() or [None])[0] if not error else None
        return os.path.realpath(device) if os.path.exists(device) else None
    except ValueError:  # a NUL in the field
        return None


def _header_or_error(path):
    try:
        return luks_header(path)
    except CommandExecutionError as error:
        return {"error": str(error)}


def _clevis_unlocks(path, header, timeout, deadline):
    """{"tokens", "network", "unlocks", "error"}: does Clevis unlock a keyslot of its tokens now
    (``clevis luks pass`` on a copy of the header: it decrypts the token, asking Tang or the TPM,
    and the passphrase is tried on the copy's keyslot)? ``network``:
    a token asks Tang servers. ``error`` with no tokens: the header could not be read."""
    if "error" in header:
        return {
            "tokens": 0,
            "network": False,
            "unlocks": False,
            "error": f"no readable LUKS header: {header['error']}",
        }
    if header.get("version") == 1:
        return {
            "tokens": 0,
            "network": False,
            "unlocks": False,
            "error": "LUKS1: Clevis bindings (luksmeta) are not checked",
        }
    tokens = [t for t in header.get("tokens", []) if t["type"] == "clevis"]
    network = any(t.get("clevis", {}).get("servers") for t in tokens)
    drift = _pcr_drift(header) if any(t.get("clevis", {}).get("tpm2") for t in tokens) else {}
    slots = [s for t in tokens for s in t.get("keyslots", [])[:1] if isinstance(s, str) and s.isdigit()]
    size = core.luks.header_bytes(header)
    if size is None:
        return {
            "tokens": len(tokens),
            "network": network,
            "unlocks": False,
            "error": "the LUKS header has no size a header has",
        }
    errors = []
    for slot in slots:
        left = deadline - time.monotonic()
        if left <= 0:
            errors.append(
                f"keyslot {slot}: not tried, the check's {round(CLEVIS_WAITS * timeout)} s for Clevis were spent"
            )
            continue
        try:
            with core.files.memory_copy(path, size) as copy:
                code, said = _clevis_pass(copy, slot, min(timeout, left))
        except OSError as error:
            errors.append(f"keyslot {slot}: {error}")
            continue
        if code == 0:
            return {
                "tokens": len(tokens),
                "network": network,
                "unlocks": True,
                "error": None,
                "pcr_drift": drift,
            }
        errors.append(f"keyslot {slot}: {said}")
    return {
        "tokens": len(tokens),
        "network": network,
        "unlocks": False,
        "error": "; ".join(errors) or None,
        "pcr_drift": drift,
    }


def clevis_opens(device, keyslot):
    """
    Does Clevis open keyslot ``keyslot`` of the LUKS2 ``device`` now (``clevis luks pass`` on an
    in-memory copy of the header, asking the Tang servers and the TPM as a boot would, its
    passphrase piped into ``cryptsetup open --test-passphrase --key-slot``)? Reads only.
    ``{"opens": bool, "error"}``.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage_host.clevis_opens /dev/vdc 1
    """
    slot = str(keyslot)
    if not slot.isdigit():
        raise CommandExecutionError(f"a keyslot is a number, not {keyslot!r}")
    path = os.path.realpath(device)
    size = core.luks.header_bytes(luks_header(device))
    if size is None:
        return {"opens": False, "error": "the LUKS header has no size a header has"}
    try:
        with core.files.memory_copy(path, size) as copy:
            code, said = _clevis_pass(copy, slot, PROOF_TIMEOUT)
    except OSError as error:
        return {"opens": False, "error": str(error)}
    return {"opens": code == 0, "error": None if code == 0 else said}


def tpm2_unseals(device, keyslot):
    """
    Does the TPM2 share of the Clevis binding in keyslot ``keyslot`` of the LUKS2 ``device``
    unseal now (``clevis decrypt`` of that share alone: no Tang server is asked, so a Tang
    outage is not taken for a changed PCR)? Reads only; the share goes to /dev/null.
    ``{"unseals": True/False, or None when the TPM could not be asked, "error"}``.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage_host.tpm2_unseals /dev/vdc 1
    """
    slot = str(keyslot)
    ids = [
        t["id"]
        for t in luks_header(device).get("tokens", [])
        if t["type"] == "clevis" and [str(s) for s in t["keyslots"]] == [slot]
    ]
    if len(ids) != 1:
        return {"unseals": None, "error": f"keyslot {slot} has no Clevis token of its own"}
    out, error = _run(["cryptsetup", "token", "export", "--token-id", str(ids[0]), os.path.realpath(device)])
    try:
        share = core.luks.tpm2_share(json.loads(out)) if not error else None
    except ValueError:
        share = None
    if share is None:
        return {"unseals": None, "error": error or f"the Clevis token of keyslot {slot} has no TPM2 share"}
    code, said = _clevis_child(core.commands.clevis_decrypt(), PROOF_TIMEOUT, stdin=share.encode())
    if code is None:
        return {"unseals": None, "error": f"clevis decrypt of the TPM2 share: {said}"}
    return {"unseals": code == 0, "error": None if code == 0 else said}


def _clevis_pass(copy, slot, timeout):
    """(exit code, what it said) of ``clevis luks pass`` on the header copy ``copy`` (a
    /proc/<pid>/fd/<n> path), its passphrase piped into ``cryptsetup open --test-passphrase
    --key-slot <slot>``: 0 only when keyslot ``slot`` itself opens (clevis checks the passphrase
    against any keyslot; a token moved onto another binding's keyslot passes that check). The copy
    is handed down as the children's own descriptor and named /dev/fd/<n>, so no process of them
    can reach another file by that number."""
    descriptor = int(copy.rsplit("/", 1)[-1])
    copied = f"/dev/fd/{descriptor}"
    return _clevis_child(
        ["clevis", "luks", "pass", "-d", copied, "-s", slot],
        timeout,
        pass_fds=(descriptor,),
        then=["cryptsetup", "open", "--test-passphrase", "--key-slot", slot, "--key-file", "-", copied],
    )


def _clevis_child(argv, timeout, stdin=None, pass_fds=(), then=None):
    """(exit code, what it said on stderr) of the Clevis command ``argv`` given ``stdin`` (bytes);
    (None, why) when a program is not installed or gave no answer within ``timeout`` s. What it
    decrypts (a passphrase, a share) goes to /dev/null, or through a pipe into the command
    ``then`` (never through this process): then 0 only when both exit 0. On a timeout each one's
    whole process group goes (clevis's curl, its subshells, a tpm2 tool waiting on the TPM)."""
    children = []
    try:
        children.append(
            subprocess.Popen(  # noqa: S603 - a fixed argv, no shell
                argv,
                stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                stdout=subprocess.PIPE if then else subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                pass_fds=pass_fds,
                start_new_session=True,
                env=CLEVIS_ENV,
            )
        )
        if then:
            children.append(
                subprocess.Popen(  # noqa: S603 - a fixed argv, no shell
                    then,
                    stdin=children[0].stdout,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    pass_fds=pass_fds,
                    start_new_session=True,
                    env=CLEVIS_ENV,
                )
            )
            children[0].stdout.close()  # the pipe's read end is the second child's alone
    except OSError as error:  # not installed; or no process to be had (EAGAIN, EMFILE, ENOMEM)
        _kill_all(children)
        if isinstance(error, FileNotFoundError):
            return None, f"{os.path.basename(str(error.filename or argv[0]))} is not installed"
        return None, f"cannot start {(then if children else argv)[0]}: {error}"
    deadline = time.monotonic() + timeout
    said = []
    try:
        for index, child in enumerate(children):
            given = stdin if index == 0 else None
            _out, err = child.communicate(given, timeout=max(0.1, deadline - time.monotonic()))
            said.append(" ".join(err.decode(errors="replace").split())[:300])
    except subprocess.TimeoutExpired:
        _kill_all(children)
        return None, f"no answer within {round(timeout)} s"
    for child, what in zip(children, said, strict=True):
        if child.returncode:
            return child.returncode, what or f"{child.args[0]} exited {child.returncode}"
    return 0, " ".join(said)


def _kill_all(children):
    """Kill the process group of each child not reaped yet (a reaped one's number may be another
    process's by now), then reap them."""
    for child in children:
        if child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
    for child in children:
        child.communicate()


TPM_SYSFS = "/sys/class/tpm/tpm0"


def pcr_values(bank, pcr_ids):
    """
    The TPM2's PCR values now: ``{pcr id: lowercase hex}`` of ``pcr_ids`` in ``bank`` (sha256...),
    read from sysfs (kernel 5.12 and later), else with ``tpm2_pcrread``. Reads only.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage_host.pcr_values sha256 [7]
    """
    try:
        ids = [int(i) for i in pcr_ids]
    except (TypeError, ValueError):
        raise CommandExecutionError(f"PCR ids are numbers 0 to 23, not {pcr_ids!r}") from None
    if not all(0 <= i <= 23 for i in ids) or bank not in core.tpm.BANKS:
        raise CommandExecutionError(f"no PCR {ids} in a bank {bank!r}")
    folder = f"{TPM_SYSFS}/pcr-{bank}"
    if os.path.isdir(folder):
        try:
            values = {}
            for pcr in ids:
                with open(f"{folder}/{pcr}", encoding="ascii") as handle:
                    values[pcr] = handle.read().strip().lower()
                if not core.tpm.valid_value(bank, values[pcr]):
                    raise CommandExecutionError(f"{folder}/{pcr} holds no {bank} PCR value")
            return values
        except (OSError, UnicodeDecodeError) as error:
            raise CommandExecutionError(f"the TPM's PCRs cannot be read from {folder}: {error}") from None
    if not os.path.exists(TPM_SYSFS):
        raise CommandExecutionError("this host has no TPM (no /sys/class/tpm/tpm0)")
    if not ids:
        return {}
    out, error = _run(["tpm2_pcrread", f"{bank}:{','.join(map(str, ids))}"])
    if error:
        raise CommandExecutionError(f"tpm2_pcrread: {error}")
    try:
        listed = core.tpm.parse_pcrread(out).get(bank, {})
    except core.tpm.PcrReadError as error:
        raise CommandExecutionError(str(error)) from None
    missing = [i for i in ids if i not in listed]
    if missing:
        raise CommandExecutionError(f"the TPM has no {bank} PCR {missing}")
    return {i: listed[i] for i in ids}


def pcr_drift(device):
    """
    For each Clevis TPM2 binding of the LUKS2 ``device`` that has the formula's PCR record: the
    PCRs that changed since it was bound, ``{keyslot: [pcr ids]}``; ``{}`` when none has a record,
    ``{"error"}`` when the TPM cannot be read. Reads only.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage_host.pcr_drift /dev/sdb
    """
    return _pcr_drift(luks_header(device))


def _pcr_drift(header):
    try:
        current = {bank: pcr_values(bank, ids) for bank, ids in core.tpm.wanted_pcrs(header).items()}
    except CommandExecutionError as error:
        return {"error": str(error)}
    return core.tpm.pcr_drift(header, current)


def unit_active(unit):
    """
    Whether the systemd ``unit`` runs (active, activating, deactivating or reloading).

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage_host.unit_active hana-storage-encrypt-hana_data.service
    """
    return _unit_active(unit)


def unit_enabled(unit):
    """
    What `systemctl is-enabled` says of the systemd ``unit`` (enabled, enabled-runtime,
    disabled...); "unknown" when it cannot say. systemctl answers with or without systemd
    running (an image build, a rescue system).

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage_host.unit_enabled clevis-luks-askpass.path
    """
    try:
        result = __salt__["cmd.run_all"](
            ["systemctl", "is-enabled", unit],
            python_shell=False,
            output_loglevel="quiet",
            ignore_retcode=True,
        )
    except CommandExecutionError:
        return "unknown"
    return (result["stdout"] or "").strip().split("\n")[0] or "unknown"


def _read(path):
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError):
        return ""


def _listdir(path):
    try:
        return os.listdir(path)
    except OSError:
        return []


def _kernel_name(path):
    """The kernel's name of a block device: 'dm-3' for /dev/mapper/mpatha, a symlink (udev) or a
    node of its own (libdevmapper without udev); the path's basename for anything else."""
    try:
        rdev = os.stat(path).st_rdev
        return os.path.basename(os.readlink(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}"))
    except OSError:
        return os.path.basename(os.path.realpath(path))


def _sysfs():
    """One dict per /sys/class/block entry: dev, size, slaves, holders, partition, dm."""
    snapshot = {}
    for name in _listdir(SYSFS_BLOCK):
        base = f"{SYSFS_BLOCK}/{name}"
        dev = _read(f"{base}/dev").strip()
        if not dev:
            continue
        size = _read(f"{base}/size").strip()
        info = {
            "dev": dev,
            "size": int(size) if size.isascii() and size.isdigit() else 0,
            "slaves": _listdir(f"{base}/slaves"),
            "holders": _listdir(f"{base}/holders"),
            "partition_of": None,
            "dm": None,
            # one LUN seen over several paths shows the same identity on each
            "wwid": next(
                (w for w in (_read(f"{base}/{f}").strip() for f in core.stack.WWID_FILES) if w),
                "",
            ),
        }
        if os.path.exists(f"{base}/partition"):
            info["partition_of"] = os.path.basename(os.path.dirname(os.path.realpath(base)))
        if os.path.isdir(f"{base}/dm"):
            info["dm"] = {
                "name": _read(f"{base}/dm/name").strip(),
                "uuid": _read(f"{base}/dm/uuid").strip(),
                "suspended": _read(f"{base}/dm/suspended").strip() == "1",
            }
        snapshot[name] = info
    return snapshot


def _mounts():
    """The mount table; a line that breaks the format is logged and left out, never the table."""
    try:
        with open("/proc/self/mountinfo", "rb") as handle:
            raw = handle.read()
    except OSError as error:
        log.warning("hana_storage: /proc/self/mountinfo unreadable: %s", error)
        return []
    malformed = []
    mounts = core.tab.parse_mountinfo(raw, malformed=malformed)
    for entry in malformed:
        log.warning("hana_storage: /proc/self/mountinfo line %s left out: %s", entry["line"], entry["error"])
    return mounts


def _run(argv):
    """Run a read-only command; (stdout, error or None). Output is never logged. A program that
    cannot be started (lvm2 not installed yet) is an error, not an exception."""
    try:
        result = __salt__["cmd.run_all"](
            argv, python_shell=False, output_loglevel="quiet", ignore_retcode=True
        )
    except CommandExecutionError as error:
        return None, f"cannot run {argv[0]}: {error}"[:300]
    if result["retcode"]:
        return None, f"{argv[0]} exited {result['retcode']}: {result['stderr'].strip()[:300]}"
    return result["stdout"], None


def _lvm_segments(devices=None, reuse=False):
    """The parsed segments of every LV (``lvs``), or {"error": ...}.

    ``devices``: the device tree the report is read with; it is kept with it. ``reuse``: the
    report kept by an earlier call of this process, while lvm.report_key says nothing it
    describes can have changed. `lvs` costs a scoped audit about half of its time (0.45 s of
    0.8 s under emulation), and a drift of a crypt device's flags leaves every LV as it was.
    """
    key = None if devices is None else core.lvm.report_key(devices)
    kept = __context__.get(LVM_REPORT)
    if reuse and key is not None and kept and kept[0] == key:
        return kept[1]
    segments = _read_lvm_segments()
    if key is not None and isinstance(segments, list):
        __context__[LVM_REPORT] = (key, segments)
    return segments


def _read_lvm_segments():
    if not salt.utils.path.which("lvs"):
        return {"error": "lvs not found (lvm2 not installed)"}
    text, error = _run(core.lvm.lvs_command())
    if error:
        return {"error": error}
    try:
        return core.lvm.parse_segments(text)
    except ValueError as err:
        return {"error": str(err)}


@contextlib.contextmanager
def _reader(path, shown=None):
    """``read(offset, size)`` on the device (or file) at ``path``: the one way this module reads
    device bytes, read-only, one descriptor for all reads. An OSError becomes a
    CommandExecutionError naming ``shown`` (default: the path)."""
    shown = shown or path
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        raise CommandExecutionError(f"cannot open {shown}: {error.strerror}") from None

    def read(offset, size):
        try:
            return os.pread(fd, size, offset)
        except OSError as error:
            raise CommandExecutionError(f"cannot read {shown}: {error.strerror}") from None

    try:
        yield read
    finally:
        os.close(fd)


def _header_of(name):
    """LUKS summary of /dev/<name>, or {"error": ...} (never raises)."""
    try:
        with _reader(f"/dev/{name}") as read:
            return core.luks.parse_header(read)
    except (ValueError, CommandExecutionError) as error:
        return {"error": str(error)}


def _claimed_uuid_of(name):
    """The UUID the LUKS2 binary header of /dev/<name> names, unchecked, when the header is one a
    luksFormat was killed while writing (luks.torn_format_uuid) and the UUID is one a format
    mark can be named by; else None."""
    try:
        with _reader(f"/dev/{name}") as read:
            claimed = core.luks.torn_format_uuid(read)
    except (ValueError, CommandExecutionError):
        return None
    return claimed if claimed and claimed.replace("-", "").isalnum() else None


def _superblock_of(name):
    try:
        with _reader(f"/dev/{name}") as read:
            return core.xfs.parse_superblock(read(0, 512))
    except (ValueError, CommandExecutionError) as error:
        return {"error": str(error)}


def _parsed_file(path, parser):
    if not os.path.exists(path):
        return []
    try:
        with open(path, encoding="utf-8") as handle:
            return parser(handle.read())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        return {"error": f"{path}: {error}"}


def _key_file_facts(plan):
    facts = {}
    for volume in plan["volumes"].values():
        path = volume["key"]["file"]
        try:
            info = os.stat(path)
            facts[path] = {
                "exists": True,
                "mode": stat.S_IMODE(info.st_mode),
                "uid": info.st_uid,
                "mtime": int(info.st_mtime),
            }
        except OSError:
            facts[path] = {"exists": False}
    return facts


def _header_backup_facts(plan):
    return {
        c["header_backup"]: header_backup(c["header_backup"])
        for volume in plan["volumes"].values()
        for c in volume["crypt"]
        if c.get("header_backup")
    }


def header_backup(path):
    """
    What a LUKS header backup file holds, read-only: ``{"exists", "mode", "uid", "uuid",
    "fingerprint", "keyslots": [{"id", "fingerprint"}], "volume_keys": [fingerprints], "tokens":
    [its Clevis tokens], "mtime"}``, or
    ``{"exists", "error"}`` (a symlink is not a backup the formula made).
    The fingerprint is the one ``luks_header`` gives the live header while they agree.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage_host.header_backup /var/lib/hana-storage/luks-headers/hana_data.luks-header
    """
    try:
        info = os.lstat(path)
    except OSError:
        return {"exists": False}
    if not stat.S_ISREG(info.st_mode):
        return {"exists": True, "error": "not a regular file"}
    try:
        with _reader(path) as read:
            header = core.luks.parse_header(read)
    except (ValueError, CommandExecutionError) as error:
        return {"exists": True, "error": str(error)}
    return {
        "exists": True,
        "mode": stat.S_IMODE(info.st_mode),
        "uid": info.st_uid,
        "uuid": header["uuid"],
        "fingerprint": header["fingerprint"],
        "keyslots": [{"id": k["id"], "fingerprint": k["fingerprint"]} for k in header["keyslots"]],
        "volume_keys": header.get("volume_keys", []),
        "tokens": [t for t in header.get("tokens", []) if t["type"] == "clevis"],
        "mtime": info.st_mtime,
    }


def _device_names(plan, devices):
    """{pillar device: {"unstable": bool, "stable": [names that stay]}}: the multipath map that
    holds it, its /dev/disk/by-id links."""
    by_id = {}
    for link in (n for n in _listdir(BY_ID) if n.startswith(BY_ID_HARDWARE)):
        by_id.setdefault(_kernel_name(f"{BY_ID}/{link}"), []).append(f"{BY_ID}/{link}")
    names = {}
    for volume in plan["volumes"].values():
        for path in volume["devices"]:
            name = _kernel_name(path)
            device = devices.get(name) or {"holders": []}
            maps = [
                devices[h]["path"] for h in device["holders"] if devices.get(h, {}).get("kind") == "multipath"
            ]
            names[path] = {
                "unstable": bool(UNSTABLE_NAME.match(path)),
                "stable": maps + sorted(by_id.get(name, [])),
            }
    return names


def _device_tree():
    """(devices, mounts) with dm tables attached; one `dmsetup table` for all devices."""
    mounts = _mounts()
    devices = core.stack.build_devices(_sysfs(), dm_tables(), mounts)
    return devices, mounts


def facts(plan, reuse_lvm=False):
    """Everything the audit of ``plan`` reads, gathered once (``disks``: each volume's disks by
    kernel name, for the beacon to map uevents). ``reuse_lvm``: the LVM report of an earlier
    call while no LV and no block device changed (see _lvm_segments); otherwise it is read."""
    devices, mounts = _device_tree()
    headers = {}
    for device in devices.values():
        if device["kind"] == "crypt":
            backing = core.stack.backing_device(device)
            if backing and backing in devices and backing not in headers:
                headers[backing] = _header_of(backing)
    mountpoints = {v["mountpoint"] for v in plan["volumes"].values()}
    fs_dm_names = {v["fs_dm_name"] for v in plan["volumes"].values()}
    by_dev = {d["dev"]: n for n, d in devices.items()}
    tops = {by_dev.get(m["dev"]) for m in mounts if m["mountpoint"] in mountpoints and m["fstype"] == "xfs"}
    tops |= {n for n, d in devices.items() if d["dm_name"] in fs_dm_names}  # present, maybe unmounted
    superblocks = {}
    for name in tops - {None}:
        # a read through a suspended device would block until it is resumed
        if any(devices[n]["suspended"] for n in core.stack.stack(devices, name)):
            superblocks[name] = {
                "error": "not read: a device of the stack is suspended",
                "unread": "suspended",
            }
        else:
            superblocks[name] = _superblock_of(name)
    for mount in mounts:  # a mounted XFS's size: its own, not the superblock's copy on the device
        name = by_dev.get(mount["dev"])
        if mount["mountpoint"] in mountpoints and "data_bytes" in superblocks.get(name, {}):
            with contextlib.suppress(CommandExecutionError):
                superblocks[name]["data_bytes"] = mounted_xfs_bytes(mount["mountpoint"], mount["dev"])
    closed = _closed_headers(plan, devices)
    backups = _header_backup_facts(plan)
    return {
        "devices": devices,
        "mounts": mounts,
        "headers": headers,
        "previous_keys": _previous_key_facts(plan, devices, headers),
        "closed_headers": closed,
        "backup_keyslots": _backup_keyslot_facts(plan, devices, headers, closed, backups),
        "lvm_scans": _lvm_scans_for(plan, devices),
        "superblocks": superblocks,
        "lvm": _lvm_segments(devices, reuse=reuse_lvm),
        "crypttab": _parsed_file("/etc/crypttab", core.tab.parse_crypttab),
        "fstab": _parsed_file("/etc/fstab", core.tab.parse_fstab),
        "key_files": _key_file_facts(plan),
        "header_backups": backups,
        "device_names": _device_names(plan, devices),
        "crypto_drivers": _crypto_drivers(devices),
        "disks": {n: sorted(_kernel_name(d) for d in v["devices"]) for n, v in plan["volumes"].items()},
        "in_place": _in_place_progress(plan),
        "reencrypting": _reencryptions_running(plan, devices),
        "today": datetime.date.today().isoformat(),  # the volume keys' cryptoperiod (HANA-KEY-010)
    }


def _in_place_progress(plan):
    """{volume: {"mode", "running", "progress"}} of each volume whose LV is under the formula's
    encryption in place (encrypt_in_place): the header read natively, the unit asked only then."""
    found = {}
    for name, volume in plan["volumes"].items():
        if volume.get("encrypt_in_place") and volume.get("spare"):
            moving = _moves_progress(name, volume)
            if moving:
                found[name] = moving
            continue
        if not volume.get("encrypt_in_place") or not os.path.exists(volume["lv_path"]):
            continue
        try:
            fact = luks_header(volume["lv_path"]).get("reencryption")
        except CommandExecutionError:
            continue  # not LUKS (yet): nothing under way
        if not fact:
            continue
        unit = core.inplace.unit_name(volume["crypt_name"])
        found[name] = {
            "mode": fact.get("mode"),
            "running": _unit_active(unit),
            "progress": core.inplace.last_progress(_unit_output(unit)),
        }
    return found


def _moves_progress(name, volume):
    """The encryption in place below LVM of ``name`` as _in_place_progress has it, while its
    ledger says it began and has not ended: mode "moves", the overall percent (moves done and
    the current pvmove's copy), the step's description; None otherwise or when it cannot be read."""
    try:
        plan, ledger = core.move_runner.read_plan(name), core.move_runner.read_ledger(name)
        if plan is None or ledger is None or ledger["done"]:
            return None
        facts = core.move_runner.read_facts(plan, test_keys=False)
    except (core.moves.MovesError, core.move_runner.StepFailed, core.tab.TabError, OSError):
        return None
    return {
        "mode": "moves",
        "running": _unit_active(core.inplace.unit_name(volume["crypt_name"])),
        "progress": {"percent": core.moves.percent(plan, facts), "eta_s": None},
        "text": core.moves.describe(plan, facts),
    }


def _reencryptions_running(plan, devices):
    """{crypt name: does its re-encryption run} for the plan's crypt devices whose stack holds
    cryptsetup's hotzone or overlay devices (the unit, or cryptsetup by hand); asked only then."""
    names = [d["dm_name"] for d in devices.values() if d.get("dm_name")]
    return {
        crypt["name"]: _reencryption_runs(crypt["name"], crypt["device"])
        for volume in plan["volumes"].values()
        for crypt in volume["crypt"]
        if core.inplace.leftovers(crypt["name"], names)
    }


def _closed_headers(plan, devices):
    """{crypt name: LUKS summary of its device} for the plan's crypt devices that are not open and
    hold a LUKS header (read-only: the first bytes of the device), so an erased or replaced header
    is seen while its volume is shut down too."""
    open_names = {d["dm_name"] for d in devices.values() if d["kind"] == "crypt"}
    by_dev = {d["dev"]: name for name, d in devices.items()}
    headers = {}
    for volume in plan["volumes"].values():
        for crypt in volume["crypt"]:
            if crypt["name"] in open_names or not crypt.get("header_backup"):
                continue
            try:
                rdev = os.stat(crypt["device"]).st_rdev
            except OSError:
                continue
            name = by_dev.get(f"{os.major(rdev)}:{os.minor(rdev)}")
            if name and not devices[name]["suspended"]:
                headers[crypt["name"]] = _header_of(name)
    return headers


def _lvm_scans_for(plan, devices):
    """What LVM scans (``_lvm_scans``, sorted), when a multipath map is on the host and a volume is
    above LVM (its PVs are the maps); [] otherwise, without asking LVM."""
    above = any(v["encryption"] == "above_lvm" for v in plan["volumes"].values())
    if not above or not any(d["kind"] == "multipath" for d in devices.values()):
        return []
    scans = _lvm_scans()
    return None if scans is None else sorted(scans)


KEY_SLOTS = "hana_storage_host.key_slots"  # __context__: {(device, fingerprint, key file, ...): key_slots}


def _previous_key_facts(plan, devices, headers):
    """{backing device name: {"keyslots", "error"}}: the keyslots each rotation's previous key
    opens, on the devices of the volumes whose pillar names one. Each keyslot is tried on a copy
    of the header (a KDF run each, see key_slots), once per header and key file: the answer is
    kept in __context__ while neither changes."""
    wanted = {}
    for volume in plan["volumes"].values():
        previous = volume["key"].get("previous")
        if not previous:
            continue
        crypt_names = {c["name"] for c in volume["crypt"]}
        for device in devices.values():
            if device["kind"] == "crypt" and device["dm_name"] in crypt_names:
                backing = core.stack.backing_device(device)
                if backing in headers and "error" not in headers[backing]:
                    wanted[backing] = previous["file"]
    return {
        backing: _slots_opened(f"/dev/{backing}", headers[backing], key_file)
        for backing, key_file in wanted.items()
    }


def _backup_keyslot_facts(plan, devices, headers, closed, backups):
    """{crypt name: {"live_opens", "retired", "error"}} for the devices whose header backup holds
    keyslots the live header lacks (core.rules.lost_keyslots): ``live_opens``, the live keyslots
    the volume's keys open, where one was rewritten under the same id; ``retired``, the backup's
    keyslots the pillar's previous key opens, while a rotation is on. Rare, and tried only then,
    once per header and key file (see _slots_opened)."""
    by_name = {d["dm_name"]: core.stack.backing_device(d) for d in devices.values() if d["kind"] == "crypt"}
    facts = {}
    for volume in plan["volumes"].values():
        key = volume["key"].get("file")
        previous = (volume["key"].get("previous") or {}).get("file")
        for crypt in volume["crypt"]:
            backing = by_name.get(crypt["name"])
            header = headers.get(backing) if backing else closed.get(crypt["name"])
            backup = crypt.get("header_backup")
            fact = backups.get(backup)
            if not header or "error" in header or not fact or "error" in fact or not fact.get("exists"):
                continue
            if not core.rules.lost_keyslots(fact, header):
                continue
            device = f"/dev/{backing}" if backing else crypt["device"]
            found, errors = {"live_opens": set(), "retired": set()}, []
            tries = []
            if core.rules.rewritten_keyslots(fact, header):
                tries += [("live_opens", device, header, k) for k in (key, previous) if k]
            if previous:
                tries.append(("retired", backup, fact, previous))
            for what, path, read_header, key_file in tries:
                result = _slots_opened(path, read_header, key_file)
                found[what].update(result["keyslots"])
                errors += [result["error"]] if result["error"] else []
            facts[crypt["name"]] = {k: sorted(v) for k, v in found.items()} | {
                "error": "; ".join(errors) or None
            }
    return facts


def _slots_opened(device, header, key_file):
    """key_slots of ``device``, kept in __context__ while neither its header nor the key file
    changes (a KDF run per keyslot is too dear for every audit)."""
    try:
        info = os.stat(key_file)
    except OSError as error:
        return {"keyslots": [], "error": f"{key_file}: {error.strerror}"}
    kept = __context__.setdefault(KEY_SLOTS, {})
    ident = (device, header.get("fingerprint"), key_file, info.st_ino, info.st_mtime_ns)
    if ident not in kept:
        if len(kept) > 256:  # headers that changed since: forget them all now and then
            kept.clear()
        kept[ident] = key_slots(device, key_file)
    return kept[ident]


def _crypto_drivers(devices):
    """{dm cipher: the kernel driver that serves it} for the ciphers of the open crypt devices."""
    ciphers = {
        segment["cipher"]
        for device in devices.values()
        if device["kind"] == "crypt"
        for segment in device["table"]
        if segment["target"] == "crypt"
    }
    if not ciphers:
        return {}
    try:
        with open("/proc/crypto", encoding="utf-8") as handle:
            entries = core.crypto.parse_proc_crypto(handle.read())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        return {"error": f"/proc/crypto: {error}"}
    drivers = {}
    for cipher in ciphers:
        algorithm = core.crypto.algorithm_of(cipher)
        driver = core.crypto.driver_of(entries, algorithm) if algorithm else None
        if driver:
            drivers[cipher] = {"algorithm": algorithm, **driver}
    return drivers


# ---- public functions ------------------------------------------------------------------------


def dm_tables():
    """
    The parsed ``dmsetup table`` of every mapped device, keys redacted.

    Returns ``{name: [segment, ...]}``; a crypt segment carries cipher, key type and size
    (never the key), iv_offset, device, offset, flags and sector_size.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage_host.dm_tables
    """
    if not os.path.exists(DM_DRIVER):
        return {}  # no device-mapper in this kernel (yet): nothing is mapped
    text, error = _run(["dmsetup", "table"])
    if error:
        raise CommandExecutionError(f"dmsetup table failed: {error}")
    try:
        return core.dm.parse_tables(text)
    except ValueError as error:
        raise CommandExecutionError(f"dmsetup table output unreadable: {error}") from None


def luks_header(device):
    """
    Parse the LUKS1/LUKS2 header of a device natively (both LUKS2 copies, checksums verified).

    device
        A block device (or a file holding a header), e.g. ``/dev/vdc`` or ``/dev/vg/lv``.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage_host.luks_header /dev/vdc
    """
    with _reader(os.path.realpath(device), device) as read:
        try:
            return core.luks.parse_header(read)
        except ValueError as error:
            raise CommandExecutionError(f"{device}: {error}") from None


def dm_uuid(device):
    """
    The device-mapper UUID of ``device`` (a path; symlinks followed), "" when it is not a dm
    device (or has no UUID); an error when the kernel's answer cannot be read.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage_host.dm_uuid /dev/mapper/mpatha
    """
    name = _kernel_name(device)
    if not name.startswith("dm-"):
        return ""
    try:
        with open(f"{SYSFS_BLOCK}/{name}/dm/uuid", encoding="utf-8") as handle:
            return handle.read().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise CommandExecutionError(f"the dm UUID of {device} ({name}) cannot be read: {error}") from None


def xfs_superblock(device):
    """
    The XFS superblock of a device: UUID, label, block size, stripe unit and width (bytes), and
    whether mkfs.xfs finished.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage_host.xfs_superblock /dev/mapper/hana_data
    """
    with _reader(os.path.realpath(device), device) as read:
        raw = read(0, 512)
    try:
        return core.xfs.parse_superblock(raw)
    except ValueError as error:
        raise CommandExecutionError(f"{device}: {error}") from None


def inspect():
    """
    Every block device's stack: kind, dm table (keys redacted), LUKS header summary,
    LVM segments, slaves/holders and mountpoints.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage_host.inspect
    """
    devices, mounts = _device_tree()
    lvm = _lvm_segments()
    for name, device in devices.items():
        if name.startswith(UNREAD_DEVICE_PREFIXES) or not device["size_bytes"] or device["suspended"]:
            continue
        try:
            with _reader(f"/dev/{name}") as read:
                probe = read(0, HEADER_PROBE)
        except CommandExecutionError as error:
            device["read_error"] = str(error)
            continue
        if core.luks.is_luks(probe):
            device["luks"] = _header_of(name)
        if device["kind"] == "lv" and isinstance(lvm, list):
            device["lvm"] = [s for s in lvm if s["dm_path"] == device["path"]]
    for device in devices.values():
        if device["kind"] == "crypt":
            backing = core.stack.backing_device(device)
            device["backing_device"] = backing
    by_dev = {d["dev"]: n for n, d in devices.items()}
    stacks = {}
    for mount in mounts:
        name = by_dev.get(mount["dev"])
        stacks[mount["mountpoint"]] = {
            "source": mount["source"],
            "fstype": mount["fstype"],
            "options": mount["options"] + mount["super_options"],
            "stack": core.stack.describe(devices, name) if name else None,
        }
    return {"devices": devices, "mounts": stacks, "lvm": lvm}


def signatures(device):
    """(signatures, partition table type) of ``device`` from low-level probing (`blkid -p`)."""
    return _blkid(device)


def in_place_facts(device, crypt_name, mountpoint, shift=None):
    """
    Where the encryption in place of ``device`` (a volume's LV) as ``crypt_name`` stands, and
    what it needs, read-only (``hana_storage_core.inplace``):

    ``signature`` (blkid's TYPE, "" for none), ``reencryption`` (the LUKS2 header's, or None),
    ``mapped`` (/dev/mapper/<crypt_name> exists), ``leftovers`` (cryptsetup's hotzone and
    overlay devices of it), ``unit`` and ``running`` (the systemd unit that encrypts it),
    ``progress`` (its last ``--progress-json`` line, parsed, or None), ``mounted_from``
    ("device", "crypt", "other" or None: what is mounted at ``mountpoint``), ``users``
    ([{"pid", "comm"}]: processes with a file, directory or mapping on that filesystem),
    ``suspended`` (the mapping and those leftovers that are suspended), ``device_bytes``, and
    of an XFS on ``device``: ``fs_bytes``, ``fs_sector``, the LV's ``lv_tags`` and, once a tag
    records its size before the extension, ``tail``: what its last ``shift`` bytes hold
    (inplace.tail_state), and ``head_copy`` (inplace.head_copy: how far the state's own copy of
    its first bytes got). ``running`` is true while the unit runs, or any
    ``cryptsetup reencrypt`` (one started by hand too). ``key_day``: the day this route made
    the volume key (inplace.KEY_DAY_TAG) of a LUKS2 header with no re-encryption under way and
    no date token of ours yet, else None.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage_host.in_place_facts /dev/vg_hana_data/lv_hana_data hana_data /hana/data
    """
    signatures, _ = _blkid(device)
    signature = signatures[0]["type"] if signatures else ""
    header = luks_header(device) if signature == "crypto_LUKS" else {}
    unit = core.inplace.unit_name(crypt_name)
    facts = {
        "signature": signature,
        "reencryption": header.get("reencryption"),
        "key_day": None,
        **_reencryption_run(device, crypt_name, unit),
        "progress": None,
        "mounted_from": None,
        "users": [],
        "device_bytes": block_bytes(device),
        "fs_bytes": None,
        "fs_sector": None,
        "lv_tags": [],
        "head_copy": None,
        "tail": None,
    }
    if facts["running"] or facts["reencryption"]:
        facts["progress"] = core.inplace.last_progress(_unit_output(unit))
    live = mounted_at(mountpoint)
    if live:
        crypt = f"/dev/mapper/{crypt_name}"
        ours = {"device": _block_number(device), "crypt": _block_number(crypt) if facts["mapped"] else None}
        facts["mounted_from"] = next((k for k, v in ours.items() if v == live), "other")
        facts["users"] = _processes_using(live)
    no_date = (
        header.get("version") == 2
        and not facts["reencryption"]
        and core.reencrypt.volume_key_date(header, datetime.date.today()) is None
    )
    unencrypted = signature in ("xfs", "")  # "": an init cut off may have torn the XFS's superblock
    # read whatever the LV holds (the copy's tags left on a LUKS2 LV are dropped), past the
    # suspended devices a killed re-encryption may leave in the stack: LVM waits on them
    tags, error = _run(["lvs", *core.lvm.NO_SUSPENDED, "--noheadings", "-o", "lv_tags", device])
    if error and (unencrypted or no_date):
        raise CommandExecutionError(f"the tags of {device} cannot be read: {error}")
    facts["lv_tags"] = [] if error else [t for t in tags.strip().split(",") if t]
    facts["key_day"] = core.inplace.tagged_key_day(facts["lv_tags"]) if no_date else None
    facts["head_copy"] = core.inplace.head_copy(facts["lv_tags"])
    if unencrypted and shift and any(t.startswith(core.inplace.PLAIN_TAG) for t in facts["lv_tags"]):
        facts["tail"] = tail_state(device, shift)
    if signature == "xfs":
        superblock = xfs_superblock(device)
        facts["fs_sector"] = superblock["sectsize"]
        facts["fs_bytes"] = (
            mounted_xfs_bytes(mountpoint, live)
            if facts["mounted_from"] == "device"
            else superblock["data_bytes"]
        )
    return facts


def reencrypt_facts(device, crypt_name, key_file, fs_device):
    """
    Where the re-encryption online of the LUKS2 ``device`` (open as ``crypt_name``) stands,
    read-only (``hana_storage_core.reencrypt.stage`` takes these):

    ``header`` (the parsed header, or None when the device has no LUKS header), ``mapped``,
    ``leftovers``, ``suspended``, ``unit``, ``running`` and ``progress`` (as in_place_facts),
    ``fs_sector`` (the sector size of the XFS on ``fs_device``: the crypt device above LVM; None
    when not read, or ``fs_device`` is None), ``keyslot`` (the lowest keyslot the key in
    ``key_file`` opens, None for none).

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage_host.reencrypt_facts /dev/vg_hana_data/lv_hana_data hana_data \
            /etc/hana-storage/keys/hana.key /dev/mapper/hana_data
    """
    unit = core.inplace.unit_name(crypt_name)
    try:
        header = luks_header(device)
    except CommandExecutionError:
        header = None
    facts = {
        "header": header if header and header.get("version") else None,
        **_reencryption_run(device, crypt_name, unit),
        "progress": None,
        "fs_sector": None,
        "keyslot": None,
    }
    if facts["header"] is None:
        return facts
    if facts["running"] or facts["header"].get("reencryption"):
        facts["progress"] = core.inplace.last_progress(_unit_output(unit))
    if fs_device and not facts["suspended"]:  # a read through a suspended device would hang
        with contextlib.suppress(CommandExecutionError):
            facts["fs_sector"] = xfs_superblock(fs_device)["sectsize"]
    if not facts["header"].get("reencryption"):
        opened = key_slots(device, key_file)
        facts["keyslot"] = min(opened["keyslots"]) if opened["keyslots"] else None
        facts["keyslot_error"] = opened["error"]
    return facts


def _reencryption_run(device, crypt_name, unit):
    """What runs a LUKS2 re-encryption of ``device`` (open as ``crypt_name``) and what a killed
    run left, read-only: ``mapped``, ``leftovers`` and ``suspended`` (inplace.leftovers: its
    hotzone and overlay devices, and those of the stack that are suspended), ``running`` (the
    ``unit`` runs, or any ``cryptsetup reencrypt`` of it, one started by hand too)."""
    mapped = {info["dm"]["name"]: info["dm"]["suspended"] for info in _sysfs().values() if info["dm"]}
    leftovers = core.inplace.leftovers(crypt_name, sorted(mapped))
    return {
        "mapped": crypt_name in mapped,
        "leftovers": leftovers,
        "suspended": [n for n in [crypt_name, *leftovers] if mapped.get(n)],
        "unit": unit,
        "running": _reencryption_runs(crypt_name, device),
    }


def _reencryption_runs(crypt_name, device):
    """Its unit runs, or any ``cryptsetup reencrypt`` of it (one started by hand too)."""
    return _unit_active(core.inplace.unit_name(crypt_name)) or _reencrypt_running(crypt_name, device)


def moves_stored_plan(volume_name):
    """The plan of the encryption in place below LVM of ``volume_name`` as the state last wrote
    it for its unit (moves.plan), or None."""
    return core.move_runner.read_plan(volume_name)


def moves_facts(plan):
    """
    Where the encryption in place below LVM of a volume stands, read-only: ``plan`` (moves.plan,
    as the state builds it), its ledger (None before the first start), the facts moves.next_step
    decides on, the step that comes next, and whether its unit runs.
    """
    volume = plan["volume"]
    unit = core.inplace.unit_name(plan["spare"]["name"].removesuffix(core.pillar.SPARE_SUFFIX))
    ledger = core.move_runner.read_ledger(volume)
    facts = core.move_runner.read_facts(plan)
    running = unit_active(unit)
    return {
        "ledger": ledger,
        "facts": facts,
        "step": core.moves.next_step(plan, facts, ledger or core.moves.new_ledger()),
        "unit": unit,
        "running": running,
    }


def moves_pending(volume):
    """
    Whether ``volume`` (its plan) is being encrypted in place below LVM: a raw device or the
    spare's crypt device is a PV of its VG, or a ledger says the moves began and have not
    ended. While it is, the moves' unit owns its devices and the volume's other states wait
    (map.jinja).
    """
    if volume.get("encryption") != "below_lvm" or not volume.get("spare"):
        return False
    try:
        ledger = core.move_runner.read_ledger(volume["name"])
        rows = core.move_runner.pv_rows() if ledger is None else {}
    except (core.moves.MovesError, core.move_runner.StepFailed, OSError):
        return True  # not known: the moves' state says why, the volume's other states wait
    if ledger is not None:
        return not ledger["done"]
    paths = [*volume["devices"], core.moves.mapper(volume["spare"]["name"])]
    return any(
        rows.get(os.path.realpath(p), {}).get("vg") == volume["vg"] for p in paths if os.path.exists(p)
    )


def tail_state(device, shift):
    """
    What the last ``shift`` bytes of ``device`` (an LV grown for an encryption in place) hold,
    against its first ``shift`` bytes, read-only: "zero", "copy", "partial" or "other"
    (hana_storage_core.inplace.tail_state).

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage_host.tail_state /dev/vg_hana_data/lv_hana_data 16777216
    """
    size = block_bytes(device)
    if not size or size < 2 * shift:
        return "other"
    try:
        fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        raise CommandExecutionError(f"{device} cannot be read: {error.strerror}") from None
    try:
        head, tail = os.pread(fd, shift, 0), os.pread(fd, shift, size - shift)
    except OSError as error:
        raise CommandExecutionError(f"{device} cannot be read: {error.strerror}") from None
    finally:
        os.close(fd)
    if len(head) != shift or len(tail) != shift:
        return "other"
    return core.inplace.tail_state(head, tail)


DEVICE_ROOT = "/dev/"  # where a device a relative argv word names can be
# cryptsetup's options whose value is a file, never the device: not stat'ed (a key on a dead
# NFS mount would hold every apply and the beacon)
_CRYPTSETUP_FILE_OPTIONS = frozenset(
    {b"-d", b"--key-file", b"--header", b"--header-backup-file", b"--volume-key-file", b"--master-key-file"}
)


def _reencrypt_running(crypt_name, device):
    """Does any process run ``cryptsetup reencrypt`` of ``device`` or of the mapping
    ``crypt_name``? A device is named in argv by any path to it (a /dev/disk/by-* link, the dm-N
    node, a path relative to the process's directory under /dev): paths are compared by the
    block device they open. Asked while a re-encryption's stack exists, maybe frozen, so nothing
    here may block on it: processes are picked by /proc/<pid>/comm (reading a cmdline takes the
    process's memory lock, which a thread faulting on the frozen volume holds), and nothing is
    stat'ed but a word that may name a device (a relative one only under /dev). A stopped
    cryptsetup (Ctrl-Z) runs nothing: its hotzone waits."""
    names = {os.fsencode(crypt_name), os.fsencode(device)}
    numbers = {_block_number(device), _block_number(f"/dev/mapper/{crypt_name}")} - {None}
    for pid in _listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/comm", "rb") as handle:
                if handle.read().strip() != b"cryptsetup":
                    continue
            with open(f"/proc/{pid}/stat", "rb") as handle:
                if handle.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t"):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")  # bounded by ARG_MAX; the device comes last
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except (OSError, IndexError):
            continue
        if b"reencrypt" not in argv:
            continue
        if names & set(argv):
            return True
        for option, arg in itertools.pairwise(argv):
            if not arg or arg.startswith(b"-") or option in _CRYPTSETUP_FILE_OPTIONS:
                continue
            if arg.startswith(b"/"):
                path = os.fsdecode(arg)
            else:
                path = os.path.join(cwd, os.fsdecode(arg))
                if not path.startswith(DEVICE_ROOT):
                    continue
            if _block_number(path) in numbers:
                return True
    return False


def _block_number(path):
    """major:minor of the block device at ``path`` (a link followed), None for anything else
    (a key file, an image file: their st_rdev is 0 and would match each other)."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return None
    return f"{os.major(info.st_rdev)}:{os.minor(info.st_rdev)}" if stat.S_ISBLK(info.st_mode) else None


def _unit_active(unit):
    result = __salt__["cmd.run_all"](
        ["systemctl", "is-active", unit], python_shell=False, output_loglevel="quiet", ignore_retcode=True
    )
    return (result["stdout"] or "").strip() in ("active", "activating", "deactivating", "reloading")


def _unit_output(unit):
    """The last lines a unit wrote (the journal keeps them after the unit is gone)."""
    text, _ = _run(["journalctl", "--unit", unit, "--output", "cat", "--lines", "40", "--no-pager"])
    return text or ""


def _processes_using(dev):
    """[{"pid", "comm"}] of the processes with a file, directory or memory mapping on the
    filesystem of ``dev`` (major:minor), as fuser -m finds them, read from /proc."""
    major, minor = (int(n) for n in dev.split(":"))
    wanted = os.makedev(major, minor)
    found = []
    for pid in _listdir("/proc"):
        if not pid.isdigit():
            continue
        base = f"/proc/{pid}"
        links = [f"{base}/{name}" for name in ("cwd", "root", "exe")]
        links += [f"{base}/fd/{fd}" for fd in _listdir(f"{base}/fd")]
        uses = any(_st_dev(link) == wanted for link in links) or _maps_device(
            _read(f"{base}/maps"), major, minor
        )
        if uses and pid != core.files.proc_pid():
            found.append({"pid": int(pid), "comm": _read(f"{base}/comm").strip()})
    return found


def _st_dev(path):
    try:
        return os.stat(path).st_dev
    except OSError:
        return None


def _maps_device(maps, major, minor):
    """Does a line of /proc/<pid>/maps map a file of device major:minor (its 4th field, hex)?"""
    for line in maps.splitlines():
        fields = line.split(None, 5)
        if len(fields) < 5 or fields[4] == "0":
            continue
        high, _, low = fields[3].partition(":")
        try:
            if (int(high, 16), int(low, 16)) == (major, minor):
                return True
        except ValueError:
            continue
    return False


def mounted_at(mountpoint):
    """The major:minor of what is mounted at ``mountpoint``, or None."""
    found = [m["dev"] for m in _mounts() if m["mountpoint"] == mountpoint]
    return found[-1] if found else None


# ---- the data-loss guard's view --------------------------------------------------------------


def _pv_groups():
    """{kernel name of a PV: its VG ('' for an orphan PV)} from a `pvs` read now: the guard
    decides what may be written from it, never from a report read earlier in the run (a PV
    suspended then is missing from it). The steps after it read this one. {} when pvs failed:
    every PV's VG is then unknown."""
    pvs = _read_pv_room()
    if not isinstance(pvs, list):
        log.warning("hana_storage: the PVs are not known: %s", pvs["error"])
        return {}
    _keep("pvs", pvs)
    return {_kernel_name(pv["pv"]): pv["vg"] for pv in pvs}


def _lvm_scans():
    """The kernel names of every device LVM would scan (``pvs -a``), or None when it cannot be told."""
    if not salt.utils.path.which("pvs"):
        return None
    text, error = _run(core.lvm.pvs_command(every_device=True))
    if error:
        log.warning("hana_storage: pvs -a failed: %s", error)
        return None
    try:
        return {_kernel_name(pv["pv"]) for pv in core.lvm.parse_pvs(text)}
    except ValueError as err:
        log.warning("hana_storage: pvs -a output unreadable: %s", err)
        return None


def _multipath_paths(name):
    """The paths (kernel names) of the multipath map ``name``, or [] for any other device."""
    uuid = _read(f"{SYSFS_BLOCK}/{name}/dm/uuid").strip()
    if not core.stack.is_multipath_uuid(uuid):
        return []
    return sorted(_listdir(f"{SYSFS_BLOCK}/{name}/slaves"))


def _blkid(path):
    """(signatures, partition table type) from low-level probing (`blkid -p`)."""
    result = __salt__["cmd.run_all"](
        ["blkid", "-p", "-o", "export", path],
        python_shell=False,
        output_loglevel="quiet",
        ignore_retcode=True,
    )
    if result["retcode"] == BLKID_NOTHING:
        return [], None
    if result["retcode"] == BLKID_AMBIVALENT:
        return [{"type": "ambivalent (several signatures)", "usage": "unknown"}], None
    if result["retcode"]:
        raise CommandExecutionError(f"blkid -p {path} failed: {result['stderr'].strip()[:200]}")
    values = core.tab.parse_blkid_export(result["stdout"])
    signatures = [{"type": values["TYPE"], "usage": values.get("USAGE", "")}] if "TYPE" in values else []
    return signatures, values.get("PTTYPE")


# cryptsetup's exit codes (cryptsetup(8)): only 2 says "no key opens it".
CRYPTSETUP_EXIT = {
    1: "wrong parameters",
    2: "no key available",
    3: "out of memory",
    4: "wrong device",
    5: "device busy or already exists",
}


def _key_test(path, header, key_file, keyslot=None):
    """(opens: True|False|None, error or None): does ``key_file`` unlock the LUKS device at
    ``path`` (only its keyslot ``keyslot``, when given)?

    The key is tried on a copy of the header in memory, never on the device:
    ``cryptsetup open --test-passphrase`` repairs a damaged LUKS2 header copy as it loads it,
    which would change the device (and erase the evidence HANA-ENC-007 reports). False only
    when cryptsetup says no key opens it (exit code 2); any other failure is an error.
    """
    size = core.luks.header_bytes(header)
    if size is None:
        return (
            None,
            "LUKS header unreadable or of no size a LUKS header has "
            f"({header.get('error', header.get('header_size'))}): key not tried",
        )
    try:
        with core.files.memory_copy(path, size) as copy:
            result = __salt__["cmd.run_all"](
                [
                    "cryptsetup",
                    "open",
                    "--test-passphrase",
                    "--key-file",
                    key_file,
                    *([] if keyslot is None else ["--key-slot", str(keyslot)]),
                    copy,
                ],
                python_shell=False,
                output_loglevel="quiet",
                ignore_retcode=True,
            )
    except (OSError, CommandExecutionError) as error:
        return None, f"cannot copy the LUKS header of {path}: {error}"
    code = result["retcode"]
    if code == 0:
        return True, None
    if code == 2:
        return False, None
    cause = CRYPTSETUP_EXIT.get(code, "unexpected exit code")
    return None, f"cryptsetup exited {code} ({cause}): {result['stderr'].strip()[:200]}"


def _first_data(name, size):
    """First byte offset with a non-zero byte in the areas where data and metadata sit, or None.

    Read: the first 8 MiB (partition tables, LVM labels and metadata, both LUKS2 header copies
    at any header size, filesystem superblocks), the middle and the last MiB (GPT backup, md
    and LVM's second metadata area), and 64 KiB windows spread over the whole device: a disk
    zeroed at the start but holding data further in is not blank.
    """
    windows = [(0, HEAD_BYTES), (max(size // 2 - SAMPLE_BYTES // 2, 0), SAMPLE_BYTES)]
    windows.append((max(size - SAMPLE_BYTES, 0), SAMPLE_BYTES))
    step = max(size // SPREAD_WINDOWS, SPREAD_BYTES)
    windows += [(offset, SPREAD_BYTES) for offset in range(HEAD_BYTES, size, step)]
    with _reader(f"/dev/{name}") as read:
        for offset, length in sorted(windows):
            chunk = read(offset, min(length, max(size - offset, 0)))
            if chunk.count(0) != len(chunk):
                return offset + next(i for i, byte in enumerate(chunk) if byte)
    return None


def _keys_test(path, header, key_files):
    """(opens, error) of the first key that opens the device; False only when every key is
    refused; None (and why) when a test failed and no key opened it."""
    errors = []
    for key_file in key_files:
        opens, error = _key_test(path, header, key_file)
        if opens:
            return True, None
        if error:
            errors.append(error)
    return (None, "; ".join(errors)) if errors else (False, None)


FORMAT_MARKS = "hana_storage/luks-format"  # under the minion's cachedir: files named by LUKS UUID
FORMAT_STAGES = {"header": "", "payload": ".payload"}


def format_marker(uuid, stage="header"):
    """
    The file that marks a luksFormat this formula began, by the UUID it gives the header
    (``luksFormat --uuid``), for one ``stage`` of it. Both marks are made before luksFormat runs.

    header
        Removed once luksFormat has returned, or once a later run sees the header's keyslot. A
        LUKS header without a keyslot is the formula's unfinished format only while this mark
        is there; any other is damage (luksErase, an overwritten header), never blank.
    payload
        Removed once a layer (a PV, XFS) is seen inside the opened device. An opened LUKS
        device reads noise where nothing was written (the disk's zeros, decrypted): inside it,
        data without a signature is that noise only while this mark is there; any other is
        someone's data (a filesystem whose magic was erased), never blank.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage_host.format_marker 3f0c7a0e-5c55-4b5e-9d0e-6f1f9b0d2a11
    """
    if not isinstance(uuid, str) or not uuid.replace("-", "").isalnum():
        raise CommandExecutionError(f"not a LUKS UUID: {uuid!r}")
    if stage not in FORMAT_STAGES:
        raise CommandExecutionError(f"not a stage of a luksFormat: {stage!r} (header or payload)")
    return os.path.join(__opts__["cachedir"], FORMAT_MARKS, uuid + FORMAT_STAGES[stage])


RETIRE_MARKS = "hana_storage/luks-retire"  # under the minion's cachedir: <LUKS UUID>.<keyslot>


def retire_marker(uuid, keyslot):
    """
    The file that marks a ``luksKillSlot`` this formula began on keyslot ``keyslot`` of the LUKS
    header with UUID ``uuid``, made before the command runs and removed once it has returned.
    cryptsetup wipes a keyslot's area before it drops the keyslot from the metadata: killed in
    between, it leaves a keyslot no key opens. While this mark is there, such a keyslot is the
    formula's removal to finish, never a stranger's keyslot (HANA-KEY-005).

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage_host.retire_marker 3f0c7a0e-5c55-4b5e-9d0e-6f1f9b0d2a11 0
    """
    if not isinstance(uuid, str) or not uuid.replace("-", "").isalnum():
        raise CommandExecutionError(f"not a LUKS UUID: {uuid!r}")
    if not isinstance(keyslot, int) or isinstance(keyslot, bool) or not 0 <= keyslot < 32:
        raise CommandExecutionError(f"not a LUKS2 keyslot: {keyslot!r}")
    return os.path.join(__opts__["cachedir"], RETIRE_MARKS, f"{uuid}.{keyslot}")


def key_opens(path, key_file):
    """
    Whether the key in ``key_file`` opens the LUKS header at ``path`` (a device or a header
    backup file), tried once on a copy of the header in memory (one KDF run, at most one per
    keyslot): ``{"opens": True|False|None, "error": str|None}``; None when the test itself failed.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage_host.key_opens /var/lib/hana-storage/luks-headers/hana_data.luks-header /etc/hana-storage/keys/hana.key
    """
    try:
        header = luks_header(path)
    except CommandExecutionError as error:
        return {"opens": None, "error": f"no readable LUKS header: {error}"}
    opens, error = _key_test(os.path.realpath(path), header, key_file)
    return {"opens": opens, "error": error}


def key_slots(device, key_file, keyslots=None):
    """
    Which keyslots of the LUKS device ``device`` the key in ``key_file`` opens, each tried on an
    in-memory copy of the header (read-only, like ``probe``; one KDF run per keyslot): what a key
    rotation proves before and after it changes a keyslot. ``keyslots``: try only these ids.

    Returns ``{"keyslots": [ids], "error": None}``; ``error`` says why a keyslot could not be
    tried (out of memory, an unreadable header), and then the list may be short.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage_host.key_slots /dev/vdc /etc/hana-storage/keys/hana.key
    """
    path = os.path.realpath(device)
    try:
        header = luks_header(device)
    except CommandExecutionError as error:
        return {"keyslots": [], "error": f"no readable LUKS header: {error}"}
    opened, errors = [], []
    wanted = None if keyslots is None else {int(k) for k in keyslots}
    for slot in sorted(int(s["id"]) for s in header.get("keyslots", [])):
        if wanted is not None and slot not in wanted:
            continue
        opens, error = _key_test(path, header, key_file, keyslot=slot)
        if opens:
            opened.append(slot)
        elif error:
            errors.append(f"keyslot {slot}: {error}")
    return {"keyslots": opened, "error": "; ".join(errors) or None}


def _formula_lv(name):
    """Did the formula's lvcreate make the LV of kernel name ``name`` (its tag)? No when LVM
    cannot tell."""
    dm_name = _read(f"{SYSFS_BLOCK}/{name}/dm/name").strip()
    if not dm_name:
        return False
    text, error = _run(core.lvm.lv_tags_command(f"/dev/mapper/{dm_name}"))
    try:
        return not error and core.lvm.FORMULA_TAG in core.lvm.parse_lv_tags(text)
    except ValueError:
        return False


def _luks_below(name, dm_uuid):
    """The LUKS UUIDs of the opened LUKS devices an LV ``name`` (device-mapper UUID ``dm_uuid``)
    lies on, when it lies on such devices only (below LVM: PVs on LUKS payloads); [] otherwise."""
    if not dm_uuid.startswith("LVM-"):
        return []
    below = [
        core.stack.luks_uuid_of_crypt(_read(f"{SYSFS_BLOCK}/{slave}/dm/uuid").strip())
        for slave in _listdir(f"{SYSFS_BLOCK}/{name}/slaves")
    ]
    return sorted(below) if below and all(below) else []


def probe(devices, key_file=None):
    """
    What is on each device, as the data-loss guard sees it: signatures (``blkid -p``), partition
    table, PV and its VG, LUKS header and whether ``key_file`` opens it, holders, mountpoints,
    where a device without a signature holds data (``data_at``, from areas sampled over the
    whole device; ``payload_unused`` inside an opened LUKS device the formula formatted and
    nothing was written to since, or on an LV that lies on such devices only), and an XFS
    superblock's state. Read-only: not a byte of any device changes
    (the key is tried on an in-memory copy of the header). The key is only tried (argon2 costs
    seconds) on a closed LUKS device that has a keyslot.

    devices
        A device path, a comma-separated list or a list.
    key_file
        A key file to test LUKS devices with (``cryptsetup open --test-passphrase``), or a list
        of them (a volume's key and, while it is rotated, its previous key): ``key_opens`` is True
        when one of them opens the device, False only when cryptsetup says each opens no keyslot;
        when a test itself fails (out of memory, busy ...) and no key opened it, it is None and
        ``key_error`` says why.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage_host.probe /dev/vdb,/dev/vdc
    """
    devices = [d for d in salt.utils.args.split_input(devices) if d]
    key_files = [k for k in ([key_file] if isinstance(key_file, str) else key_file or []) if k]
    groups = None  # one `pvs` for all devices, and only if one of them is a PV
    scanned = False  # one `pvs -a` for all devices, and only if one of them is a multipath map
    mounts = _mounts()
    probes = {}
    for device in devices:
        path = os.path.realpath(device)
        result = {
            "device": device,
            "exists": os.path.exists(path),
            "block": False,
            "signatures": [],
            "pttype": None,
            "pv_vg": None,
            "luks": None,
            "key_opens": None,
            "key_error": None,
            "holders": [],
            "mountpoints": [],
            "data_at": None,
            "xfs": None,
            "lvm_sees_paths": [],
            "inside_luks": None,  # an opened LUKS device: the UUID of its header
            "luks_below": [],  # an LV on opened LUKS devices only (below LVM): their headers' UUIDs
            "payload_unused": False,  # ... formatted by this formula, nothing written inside yet
        }
        probes[device] = result
        if not result["exists"]:
            continue
        info = os.stat(path)
        result["block"] = stat.S_ISBLK(info.st_mode)
        if not result["block"]:
            continue
        name = _kernel_name(path)
        dev = f"{os.major(info.st_rdev)}:{os.minor(info.st_rdev)}"
        result["mountpoints"] = [m["mountpoint"] for m in mounts if m["dev"] == dev]
        result["holders"] = [
            _read(f"{SYSFS_BLOCK}/{h}/dm/name").strip() or h
            for h in _listdir(f"{SYSFS_BLOCK}/{name}/holders")
        ]
        paths = _multipath_paths(name)
        if paths:
            scanned = _lvm_scans() if scanned is False else scanned
            # LVM reading a LUN through its paths too sees every PV on it twice (duplicates)
            result["lvm_sees_paths"] = None if scanned is None else sorted(set(paths) & scanned)
        result["signatures"], result["pttype"] = _blkid(path)
        if "LVM2_member" in [s["type"] for s in result["signatures"]]:
            groups = _pv_groups() if groups is None else groups
            result["pv_vg"] = groups.get(name)
        types = [s["type"] for s in result["signatures"]]
        dm_uuid = _read(f"{SYSFS_BLOCK}/{name}/dm/uuid").strip()
        result["inside_luks"] = core.stack.luks_uuid_of_crypt(dm_uuid)
        result["luks_below"] = _luks_below(name, dm_uuid)
        if not types and not result["pttype"]:
            size = _read(f"{SYSFS_BLOCK}/{name}/size").strip()
            result["data_at"] = _first_data(
                name, int(size) * 512 if size.isascii() and size.isdigit() else HEAD_BYTES
            )
            formatted_here = [result["inside_luks"]] if result["inside_luks"] else result["luks_below"]
            result["payload_unused"] = (
                bool(formatted_here)
                and all(os.path.exists(format_marker(uuid, "payload")) for uuid in formatted_here)
                # an LV on those devices says nothing of them: only one the formula created
                and (not result["luks_below"] or _formula_lv(name))
            )
        if "crypto_LUKS" in types:
            header = _header_of(name)
            result["luks"] = {k: header.get(k) for k in ("version", "uuid", "error") if k in header}
            result["luks"]["reencryption"] = bool(header.get("reencryption"))
            if isinstance(header.get("keyslots"), list):
                result["luks"]["keyslots"] = len(header["keyslots"])
            if result["luks"].get("keyslots") == 0 and isinstance(header.get("uuid"), str):
                result["luks"]["format_began"] = os.path.exists(format_marker(header["uuid"]))
            elif "error" in header:  # no copy readable: a header this formula's luksFormat was writing?
                claimed = _claimed_uuid_of(name)
                if claimed:
                    result["luks"].update(uuid=claimed, format_began=os.path.exists(format_marker(claimed)))
            # an open LUKS device is judged by who holds it, one without a keyslot opens for nobody
            if key_files and not result["holders"] and result["luks"].get("keyslots") != 0:
                result["key_opens"], result["key_error"] = _keys_test(f"/dev/{name}", header, key_files)
        if "xfs" in types:
            result["xfs"] = _superblock_of(name)
    return probes
