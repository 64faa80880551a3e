"""Inspect, audit and validate encrypted SAP HANA storage.

Interfaces (stable): ``settings``, ``validate_pillar``, ``inspect``, ``luks_header``,
``dm_tables``, ``audit``, ``probe``, ``remediate``, ``io_check``. Pure logic lives in
``_utils/hana_storage_*`` and is reached through ``__utils__``; this module only gathers facts
from the host: sysfs, one `dmsetup table`, one `lvs`, and LUKS headers and XFS superblocks read
straight from the devices. Nothing here writes to a device: ``remediate`` goes through the
formula's states, ``io_check`` writes one test file on a mounted volume.
"""

import contextlib
import copy
import hashlib
import importlib.util
import json
import logging
import os
import re
import secrets
import stat

import salt.utils.args
import salt.utils.data
import salt.utils.path
import salt.utils.platform
import salt.utils.yaml
from salt.exceptions import CommandExecutionError

log = logging.getLogger(__name__)

__virtualname__ = "hana_storage"

SCHEMA_URL = "salt://hana/storage/schema.json"
DEFAULTS_URL = "salt://hana/storage/parameters/defaults.yaml"
SYSTEM_MOUNTS = ("/", "/boot", "/boot/efi", "/usr", "/var")
SYSFS_BLOCK = "/sys/class/block"
# Where a disk's identity is: SCSI (SAN LUNs), NVMe, virtio (its serial)
WWID_FILES = ("device/wwid", "wwid", "serial", "device/serial")
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
        return False, "hana_storage: only Linux has dm-crypt, LVM and XFS"
    if not salt.utils.path.which("dmsetup"):
        return False, "hana_storage: dmsetup not found (install the dmsetup or device-mapper package)"
    if importlib.util.find_spec("jsonschema") is None:
        return False, (
            "hana_storage: the jsonschema Python package is missing from the Python that runs Salt "
            "(hana.storage.packages installs it; by hand: salt-pip install jsonschema)"
        )
    return __virtualname__


def _util(name):
    return __utils__[f"hana_storage_{name}"]


# ---- the pillar ------------------------------------------------------------------------------


def _formula_file(url):
    """Read a file of the formula through the fileserver, cached for this process."""
    cache = __context__.setdefault("hana_storage.files", {})
    if url not in cache:
        text = __salt__["cp.get_file_str"](url)
        if not text:
            raise CommandExecutionError(
                f"cannot read {url}: is the formula in file_roots? (see conf/master.d/hana-storage.conf)"
            )
        cache[url] = text
    return cache[url]


def _schema():
    return json.loads(_formula_file(SCHEMA_URL))


def _defaults():
    return salt.utils.yaml.safe_load(_formula_file(DEFAULTS_URL)) or {}


def _merged(pillar=None):
    if pillar is None:
        # not pillar.get: Salt 3008 masks the values it returns outside renderers
        pillar = salt.utils.data.traverse_dict_and_list(__pillar__, "hana:storage", {})
    if not isinstance(pillar, dict):
        return None, [f"hana:storage: must be a mapping, got {type(pillar).__name__}"]
    return _util("pillar.merge")(_defaults(), pillar), []


def _device_facts(config):
    facts = {}
    for volume in (config.get("volumes") or {}).values():
        for device in (volume or {}).get("devices", []) if isinstance(volume, dict) else []:
            if not isinstance(device, str):
                continue
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


def _system_devices():
    """Device paths that hold the running system (/, /boot, /usr, /var, swap), disks included."""
    devices = _util("stack.build_devices")(_sysfs(), {}, _mounts())
    tops = {n for n, d in devices.items() if set(d["mountpoints"]) & set(SYSTEM_MOUNTS)}
    for line in _read("/proc/swaps").splitlines()[1:]:
        path = line.split()[0] if line.split() else ""
        name = _kernel_name(path)
        if path.startswith("/dev/") and name in devices:
            tops.add(name)
    names = set()
    for top in tops:
        for name in _util("stack.stack")(devices, top):
            names.add(name)
            parent = devices[name]["partition_of"]
            if parent:
                names.add(parent)
    return sorted(f"/dev/{name}" for name in names)


def validate_pillar(pillar=None, host_checks=True):
    """
    Validate ``hana:storage`` (JSON Schema, then semantic and host checks).

    Returns a list of errors, each naming its key path; an empty list means valid.

    pillar
        A ``hana:storage`` mapping to check instead of this minion's pillar.
    host_checks
        Also check devices on this host (exist, are block devices, do not hold the system).

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage.validate_pillar
    """
    config, errors = _merged(pillar)
    if errors:
        return errors
    facts = None
    if host_checks:
        facts = {"devices": _device_facts(config), "system_devices": _system_devices()}
    return _util("pillar.validate")(config, _schema(), facts, _util("rules.auto_rules")())


def settings(pillar=None, host_checks=True):
    """
    The normalised plan the states, the audit and the beacon work from.

    Returns ``{"valid": bool, "errors": [...], "config": {...} or None}``; the config never
    carries key material (a pillar key is named by its pillar path instead).

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage.settings
    """
    systemd = (__grains__.get("systemd") or {}).get("version")  # the crypttab reader
    if not host_checks:
        # depends on the pillar alone: worked out once per pillar (a state run renders many SLS)
        config, errors = _merged(pillar)
        digest = hashlib.sha256(
            json.dumps([config, errors, systemd], sort_keys=True, default=str).encode()
        ).hexdigest()
        cached = __context__.get("hana_storage.plan")
        if cached and cached[0] == digest:
            return copy.deepcopy(cached[1])
    errors = validate_pillar(pillar, host_checks=host_checks)
    if errors:
        result = {"valid": False, "errors": errors, "config": None}
    else:
        config, _ = _merged(pillar)
        result = {"valid": True, "errors": [], "config": _util("pillar.normalize")(config, systemd)}
    if not host_checks:
        __context__["hana_storage.plan"] = (digest, copy.deepcopy(result))
    return result


def _plan(pillar=None):
    """The plan for read-only work: host checks off, so a missing disk is audited, not refused."""
    result = settings(pillar, host_checks=False)
    if not result["valid"]:
        raise CommandExecutionError(_util("pillar.validation_summary")(result["errors"]))
    return result["config"]


# ---- facts from the host ---------------------------------------------------------------------


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
            "size": int(size) if size.isdigit() else 0,
            "slaves": _listdir(f"{base}/slaves"),
            "holders": _listdir(f"{base}/holders"),
            "partition_of": None,
            "dm": None,
            # one LUN seen over several paths shows the same identity on each
            "wwid": next(
                (w for w in (_read(f"{base}/{f}").strip() for f in WWID_FILES) if w),
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
    mounts = _util("tab.parse_mountinfo")(raw, malformed=malformed)
    for entry in malformed:
        log.warning("hana_storage: /proc/self/mountinfo line %s left out: %s", entry["line"], entry["error"])
    return mounts


def _run(argv):
    """Run a read-only command; (stdout, error or None). Output is never logged."""
    result = __salt__["cmd.run_all"](argv, python_shell=False, output_loglevel="quiet", ignore_retcode=True)
    if result["retcode"]:
        return None, f"{argv[0]} exited {result['retcode']}: {result['stderr'].strip()[:300]}"
    return result["stdout"], None


def _dm_tables():
    text, error = _run(["dmsetup", "table"])
    if error:
        if "No devices found" in error or "device-mapper" in error:
            return {}
        raise CommandExecutionError(f"dmsetup table failed: {error}")
    return _util("dm.parse_tables")(text)


def _lvm_segments():
    if not salt.utils.path.which("lvs"):
        return {"error": "lvs not found (lvm2 not installed)"}
    text, error = _run(_util("lvm.lvs_command")())
    if error:
        return {"error": error}
    try:
        return _util("lvm.parse_segments")(text)
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
            return _util("luks.parse_header")(read)
    except (ValueError, CommandExecutionError) as error:
        return {"error": str(error)}


def _superblock_of(name):
    try:
        with _reader(f"/dev/{name}") as read:
            return _util("xfs.parse_superblock")(read(0, 512))
    except (ValueError, CommandExecutionError) as error:
        return {"error": str(error)}


def _parsed_file(path, parser):
    if not os.path.exists(path):
        return []
    try:
        with open(path, encoding="utf-8") as handle:
            return _util(parser)(handle.read())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        return {"error": f"{path}: {error}"}


def _key_file_facts(plan):
    facts = {}
    for volume in plan["volumes"].values():
        path = volume["key"]["file"]
        try:
            info = os.stat(path)
            facts[path] = {"exists": True, "mode": stat.S_IMODE(info.st_mode), "uid": info.st_uid}
        except OSError:
            facts[path] = {"exists": False}
    return facts


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
    devices = _util("stack.build_devices")(_sysfs(), _dm_tables(), mounts)
    return devices, mounts


def _facts(plan):
    """Everything the audit reads, gathered once."""
    devices, mounts = _device_tree()
    stacks = {name: _util("stack.describe")(devices, name) for name in devices}
    headers = {}
    for device in devices.values():
        if device["kind"] == "crypt":
            backing = _util("stack.backing_device")(device)
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
        if any(devices[n]["suspended"] for n in stacks[name]["devices"]):
            superblocks[name] = {"error": "not read: a device of the stack is suspended"}
        else:
            superblocks[name] = _superblock_of(name)
    return {
        "devices": devices,
        "stacks": stacks,
        "mounts": mounts,
        "headers": headers,
        "superblocks": superblocks,
        "lvm": _lvm_segments(),
        "crypttab": _parsed_file("/etc/crypttab", "tab.parse_crypttab"),
        "fstab": _parsed_file("/etc/fstab", "tab.parse_fstab"),
        "key_files": _key_file_facts(plan),
        "device_names": _device_names(plan, devices),
        "crypto_drivers": _crypto_drivers(devices),
    }


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
            entries = _util("crypto.parse_proc_crypto")(handle.read())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        return {"error": f"/proc/crypto: {error}"}
    drivers = {}
    for cipher in ciphers:
        algorithm = _util("crypto.algorithm_of")(cipher)
        driver = _util("crypto.driver_of")(entries, algorithm) if algorithm else None
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

        salt '*' hana_storage.dm_tables
    """
    return _dm_tables()


def luks_header(device):
    """
    Parse the LUKS1/LUKS2 header of a device natively (both LUKS2 copies, checksums verified).

    device
        A block device (or a file holding a header), e.g. ``/dev/vdc`` or ``/dev/vg/lv``.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage.luks_header /dev/vdc
    """
    with _reader(os.path.realpath(device), device) as read:
        try:
            return _util("luks.parse_header")(read)
        except ValueError as error:
            raise CommandExecutionError(f"{device}: {error}") from None


def xfs_superblock(device):
    """
    The XFS superblock of a device: UUID, label, block size, stripe unit and width (bytes), and
    whether mkfs.xfs finished.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage.xfs_superblock /dev/mapper/hana_data
    """
    with _reader(os.path.realpath(device), device) as read:
        raw = read(0, 512)
    try:
        return _util("xfs.parse_superblock")(raw)
    except ValueError as error:
        raise CommandExecutionError(f"{device}: {error}") from None


def inspect():
    """
    Every block device's stack: kind, dm table (keys redacted), LUKS header summary,
    LVM segments, slaves/holders and mountpoints.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage.inspect
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
        if _util("luks.is_luks")(probe):
            device["luks"] = _header_of(name)
        if device["kind"] == "lv" and isinstance(lvm, list):
            device["lvm"] = [s for s in lvm if s["dm_path"] == device["path"]]
    for device in devices.values():
        if device["kind"] == "crypt":
            backing = _util("stack.backing_device")(device)
            device["backing_device"] = backing
    by_dev = {d["dev"]: n for n, d in devices.items()}
    stacks = {}
    for mount in mounts:
        name = by_dev.get(mount["dev"])
        stacks[mount["mountpoint"]] = {
            "source": mount["source"],
            "fstype": mount["fstype"],
            "options": mount["options"] + mount["super_options"],
            "stack": _util("stack.describe")(devices, name) if name else None,
        }
    return {"devices": devices, "mounts": stacks, "lvm": lvm}


def audit(pillar=None, volumes=None):
    """
    Compliance of this host against its ``hana:storage`` pillar.

    Returns ``{"compliant": bool, "findings": [...], "volumes": {...}}``; each finding has
    rule, severity, volume, mountpoint, device, expected, actual, remediation (auto|manual)
    and message. Rule IDs are stable (see the README's rule table).

    pillar
        A ``hana:storage`` mapping to audit against instead of this minion's pillar.
    volumes
        Audit only these volumes (names; a list or comma-separated).

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage.audit
        salt '*' hana_storage.audit volumes=log
    """
    plan = _plan(pillar)
    if volumes:
        wanted = set(salt.utils.args.split_input(volumes))
        plan = dict(plan, volumes={n: v for n, v in plan["volumes"].items() if n in wanted})
    report = _util("rules.audit")(plan, _facts(plan))
    for name, volume in plan["volumes"].items():  # kernel names, for the beacon to map uevents
        report["volumes"][name]["disks"] = sorted(_kernel_name(d) for d in volume["devices"])
    return report


def _pv_groups():
    """{kernel name of a PV: its VG ('' for an orphan PV)} from one `pvs`."""
    if not salt.utils.path.which("pvs"):
        return {}
    text, error = _run(_util("lvm.pvs_command")())
    if error:
        log.warning("hana_storage: pvs failed: %s", error)
        return {}
    try:
        return {_kernel_name(pv["pv"]): pv["vg"] for pv in _util("lvm.parse_pvs")(text)}
    except ValueError as err:
        log.warning("hana_storage: pvs output unreadable: %s", err)
        return {}


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
    values = _util("tab.parse_blkid_export")(result["stdout"])
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
KEY_TEST_MAX_HEADER = 128 << 20  # cryptsetup's own limit on a LUKS2 metadata + keyslots area


def _key_test(name, header, key_file):
    """(opens: True|False|None, error or None): does ``key_file`` unlock LUKS device /dev/<name>?

    The key is tried on a copy of the header in memory, never on the device:
    ``cryptsetup open --test-passphrase`` repairs a damaged LUKS2 header copy as it loads it,
    which would change the device (and erase the evidence HANA-ENC-007 reports). False only
    when cryptsetup says no key opens it (exit code 2); any other failure is an error.
    """
    size = header.get("data_offset")
    if not isinstance(size, int) or not 0 < size <= KEY_TEST_MAX_HEADER:
        return (
            None,
            f"LUKS header unreadable or without a data offset ({header.get('error', size)}): key not tried",
        )
    copy = os.memfd_create("hana-storage-luks-header", os.MFD_CLOEXEC)
    try:
        with _reader(f"/dev/{name}") as read:
            os.write(copy, read(0, size))
        result = __salt__["cmd.run_all"](
            [
                "cryptsetup",
                "open",
                "--test-passphrase",
                "--key-file",
                key_file,
                f"/proc/{os.getpid()}/fd/{copy}",
            ],
            python_shell=False,
            output_loglevel="quiet",
            ignore_retcode=True,
        )
    except (OSError, CommandExecutionError) as error:
        return None, f"cannot copy the LUKS header of /dev/{name}: {error}"
    finally:
        os.close(copy)
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


def probe(devices, key_file=None):
    """
    What is on each device, as the data-loss guard sees it: signatures (``blkid -p``), partition
    table, PV and its VG, LUKS header and whether ``key_file`` opens it, holders, mountpoints,
    where a device without a signature holds data (``data_at``, from areas sampled over the
    whole device), and an XFS superblock's state. Read-only: not a byte of any device changes
    (the key is tried on an in-memory copy of the header). The key is only tried (argon2 costs
    seconds) on a closed LUKS device that has a keyslot.

    devices
        A device path, a comma-separated list or a list.
    key_file
        A key file to test LUKS devices with (``cryptsetup open --test-passphrase``).
        ``key_opens`` is False only when cryptsetup says the key opens no keyslot; when the test
        itself fails (out of memory, busy ...) it is None and ``key_error`` says why.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage.probe /dev/vdb,/dev/vdc
    """
    devices = [d for d in salt.utils.args.split_input(devices) if d]
    groups = None  # one `pvs` for all devices, and only if one of them is a PV
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
        result["signatures"], result["pttype"] = _blkid(path)
        if "LVM2_member" in [s["type"] for s in result["signatures"]]:
            groups = _pv_groups() if groups is None else groups
            result["pv_vg"] = groups.get(name)
        types = [s["type"] for s in result["signatures"]]
        if not types and not result["pttype"]:
            size = _read(f"{SYSFS_BLOCK}/{name}/size").strip()
            result["data_at"] = _first_data(name, int(size) * 512 if size.isdigit() else HEAD_BYTES)
        if "crypto_LUKS" in types:
            header = _header_of(name)
            result["luks"] = {k: header.get(k) for k in ("version", "uuid", "error") if k in header}
            if isinstance(header.get("keyslots"), list):
                result["luks"]["keyslots"] = len(header["keyslots"])
            # an open LUKS device is judged by who holds it, one without a keyslot opens for nobody
            if key_file and not result["holders"] and result["luks"].get("keyslots") != 0:
                result["key_opens"], result["key_error"] = _key_test(name, header, key_file)
        if "xfs" in types:
            result["xfs"] = _superblock_of(name)
    return probes


# ---- remediation -----------------------------------------------------------------------------


SKIP_REASONS = {
    "manual_rule": "manual rule: never remediated automatically",
    "not_allowed": "not allowed by hana:storage:compliance:remediation",
    "not_mounted": "volume not mounted (HANA-MOUNT-001 is manual)",
    "no_fix": "no safe fix for this device",
}


def remediate(rules=None, pillar=None):
    """
    Apply the safe fixes, and only those: dm-crypt flags (``cryptsetup refresh --persistent``),
    crypttab, fstab and live mount options, key file mode. Never formats, opens, closes or
    unmounts anything. Works from this minion's own audit, for the rules with a fix in the rule
    table (``hana_storage_rules.RULES``) that ``hana:storage:compliance:remediation:rules``
    allows (default: all of them).

    rules
        Only these rule IDs (a list or comma-separated); default: every auto rule (a manual
        one is never fixed here, so asking for it only reports it skipped).

    Returns ``{"result", "fixed", "failed", "skipped", "remaining"}``. ``remaining`` is what a
    second audit after the fixes still finds of those rules (the first one when nothing was
    fixed): a fix counts once that audit no longer finds it. ``result`` is True only when nothing
    of those rules is left: no fix failed, none was skipped, none remains. Each skipped entry
    names its ``code``: ``manual_rule`` (never remediated automatically), ``not_allowed`` (not in
    ``hana:storage:compliance:remediation``), ``not_mounted`` (fstab needs the volume mounted),
    ``no_fix`` (no safe fix for this device); ``reason`` says it in words.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage.remediate
        salt '*' hana_storage.remediate rules=HANA-PERF-002
    """
    plan = _plan(pillar)
    policy = plan["compliance"]["remediation"]
    auto = _util("rules.auto_rules")()
    allowed = set(policy.get("rules", auto)) if policy.get("enabled", True) else set()
    wanted = set(salt.utils.args.split_input(rules) if rules else auto)
    report = _util("rules.audit")(plan, _facts(plan))
    fixed, failed, skipped = [], [], []
    done = set()
    for finding in report["findings"]:
        rule = finding["rule"]
        if rule not in wanted:
            continue
        entry = {"rule": rule, "volume": finding["volume"], "device": finding["device"]}
        fix = _util("rules.fix_for")(plan, finding, report["volumes"][finding["volume"]])
        if fix.get("code") != "manual_rule" and rule not in allowed:
            fix = {"code": "not_allowed"}
        if "code" in fix:
            skipped.append({**entry, "code": fix["code"], "reason": SKIP_REASONS[fix["code"]]})
            continue
        fun, kwargs = fix["state"], fix["kwargs"]
        if (fun, kwargs["name"]) in done:
            fixed.append({**entry, "changes": "fixed with an earlier finding"})
            continue
        done.add((fun, kwargs["name"]))
        ret = __salt__["state.single"](fun, queue=True, **kwargs)
        state = (
            next(iter(ret.values())) if isinstance(ret, dict) and ret else {"result": False, "comment": ret}
        )
        if state.get("result") is True:
            fixed.append({**entry, "changes": state.get("changes", {}), "comment": state.get("comment")})
        else:
            failed.append({**entry, "comment": state.get("comment")})
    after = _util("rules.audit")(plan, _facts(plan)) if fixed else report
    remaining = [f for f in after["findings"] if f["rule"] in wanted]
    result = not failed and not skipped and not remaining
    if not result:
        __context__["retcode"] = 1
    return {"result": result, "fixed": fixed, "failed": failed, "skipped": skipped, "remaining": remaining}


# ---- the HANA I/O check ----------------------------------------------------------------------

IO_CHECK_DIR = ".hana_storage_io_check."
SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _size_bytes(size):
    text = str(size).strip().upper().removesuffix("B").removesuffix("I")
    number, unit = (text[:-1], text[-1]) if text[-1:] in SIZE_UNITS else (text, "")
    if not number.isdigit() or int(number) <= 0:
        raise CommandExecutionError(f"size {size!r}: expected a positive number with K, M, G or T")
    return int(number) * SIZE_UNITS[unit]


@contextlib.contextmanager
def _io_check_file(mountpoint, dev, size_bytes):
    """A new root-only test file on the filesystem mounted at ``mountpoint``, named to fio by
    ``/proc/<pid>/fd/<n>``, removed afterwards.

    Whoever can write the mount root (``<sid>adm``) could plant a symlink under any name: the
    directory and the file are created here with O_EXCL and O_NOFOLLOW relative to descriptors,
    and fio opens the very inode made here, never a path someone else can redirect.
    """
    root = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    directory = f"{IO_CHECK_DIR}{secrets.token_hex(8)}"
    handle = workdir = None
    try:
        st_dev = os.fstat(root).st_dev
        if f"{os.major(st_dev)}:{os.minor(st_dev)}" != dev:
            raise CommandExecutionError(f"{mountpoint} is not the root of the mount it was ({dev})")
        os.mkdir(directory, 0o700, dir_fd=root)
        workdir = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        handle = os.open("io_check", flags, 0o600, dir_fd=workdir)
        _lay_out(handle, size_bytes)
        yield f"/proc/{os.getpid()}/fd/{handle}"
    finally:
        if handle is not None:
            os.close(handle)
            os.unlink("io_check", dir_fd=workdir)
        if workdir is not None:
            os.close(workdir)
            os.rmdir(directory, dir_fd=root)
        os.close(root)


def _lay_out(fd, size_bytes, chunk=1 << 20):
    """Write the test file to its full size, as fio's own layout would: fio re-creates a file that
    is too small by unlinking its name, which a /proc/<pid>/fd link does not allow."""
    zeros = bytes(chunk)
    written = 0
    while written < size_bytes:
        written += os.write(fd, zeros[: min(chunk, size_bytes - written)])
    os.fsync(fd)


def _mounted_at(mountpoint):
    """The major:minor of what is mounted at ``mountpoint``, or None."""
    found = [m["dev"] for m in _mounts() if m["mountpoint"] == mountpoint]
    return found[-1] if found else None


def io_check(volumes=None, size="1G", runtime=30, kpis=None, pillar=None):
    """
    Measure a mounted HANA volume with fio, the way SAP HCMT's file-system tests do: the log as
    sequential overwrite (4K, 16K, 1M, queue depth 1), the data volume as random read and write
    (16K, 64K, 1M, 16M). Each job's MB/s and latency is checked against the KPIs (defaults: log
    250 MB/s with 1 MB blocks and 1 ms for 4K/16K, data 400 MB/s read and 250 MB/s write with 16 MB
    blocks; override with ``kpis={'log:write:1m': {'min_mb_s': 400}}``).

    Writes only a test file of ``size`` in a new root-only directory in the mountpoint (never
    through a path others can redirect), removed afterwards; a volume that is
    not mounted, or lacks the space, is refused (never measure the root filesystem underneath).
    Needs fio. Numbers from a virtual machine are the hypervisor's, not the storage's.

    CLI Example:

    .. code-block:: bash

        salt 'hana*' hana_storage.io_check volumes='[log, data]' size=4G runtime=60
    """
    if not salt.utils.path.which("fio"):
        raise CommandExecutionError("hana_storage.io_check needs fio (install the fio package)")
    plan = _plan(pillar)
    try:
        kpi_table = _util("fio.kpis")(kpis)
    except ValueError as error:  # the fio util's FioError
        raise CommandExecutionError(str(error)) from None
    names = (
        salt.utils.args.split_input(volumes)
        if volumes
        else [n for n in ("log", "data") if n in plan["volumes"]]
    )
    size_bytes = _size_bytes(size)
    report, passed = {}, True
    for name in names:
        volume = plan["volumes"].get(name)
        if volume is None:
            raise CommandExecutionError(f"volume {name!r} is not in hana:storage:volumes")
        mountpoint = volume["mountpoint"]
        dev = _mounted_at(mountpoint)
        if not dev:
            raise CommandExecutionError(f"{mountpoint} is not mounted: refusing to measure what lies beneath")
        stats = os.statvfs(mountpoint)
        if stats.f_bavail * stats.f_frsize < size_bytes * 1.1:
            raise CommandExecutionError(f"{mountpoint} has less free space than {size} plus 10%")
        profile = "log" if name == "log" else "data"
        jobs = []
        with _io_check_file(mountpoint, dev, size_bytes) as path:
            for job in _util("fio.profile_jobs")(profile):
                out, error = _run(_util("fio.fio_argv")(path, job, size, int(runtime)))
                if error:
                    raise CommandExecutionError(f"fio on {mountpoint} ({job['rw']} {job['bs']}): {error}")
                try:
                    result = _util("fio.parse_result")(out)
                except ValueError as parse_error:
                    raise CommandExecutionError(f"fio on {mountpoint}: {parse_error}") from None
                check = _util("fio.verdict")(profile, job, result, kpi_table)
                passed = passed and (check is None or check["passed"])
                jobs.append({**job, **result, "kpi": check})
        report[name] = {"mountpoint": mountpoint, "profile": profile, "jobs": jobs}
    virtual = __grains__.get("virtual", "physical")
    result = {"passed": passed, "volumes": report, "size": size, "runtime_s": int(runtime)}
    if virtual != "physical":
        result["note"] = f"measured in a virtual machine ({virtual}): the numbers are the hypervisor's"
    if not passed:
        __context__["retcode"] = 1
    return result
