"""The block device stack: disk -> (crypt | LV) -> ... -> mountpoint. Pure code.

Input is a snapshot of sysfs (one dict per /sys/class/block entry), the parsed `dmsetup table`
and the parsed mountinfo; no I/O here. "Is /hana/log encrypted, at which layer, with what" is a
walk down from the mounted device through ``slaves``.
"""

import copy
import re

LVM_UUID_PREFIX = "LVM-"
CRYPT_UUID_PREFIX = "CRYPT-"
MULTIPATH_UUID_PREFIX = "mpath-"  # what multipathd names its maps' dm UUIDs
# Where a disk's identity is in its /sys/class/block entry: SCSI (SAN LUNs), NVMe, virtio (its serial)
WWID_FILES = ("device/wwid", "wwid", "serial", "device/serial")


def is_multipath_uuid(uuid):
    """Is a dm UUID one of multipathd's maps (``mpath-<wwid>``)?"""
    return isinstance(uuid, str) and uuid.startswith(MULTIPATH_UUID_PREFIX)


# a multipath map's dm UUID, or one of a partition of it (kpartx: part<N>-mpath-<wwid>)
ON_MULTIPATH = re.compile(r"(part[0-9]+-)?" + re.escape(MULTIPATH_UUID_PREFIX))


def crypttab_source(luks_uuid, backing_dm_uuid):
    """The device field of the crypttab line of a LUKS device (``luks_uuid``) on the device whose
    dm UUID is ``backing_dm_uuid`` ("" or None: not device-mapper). A partition of a map counts
    as the map: each path's partition carries the header too.

    ``UUID=``, unless it lies on a multipath map: every path of the LUN carries the same LUKS
    header, and systemd opens a ``UUID=`` line on whatever /dev/disk/by-uuid points at when the
    first device with that UUID appears - a single path, if it comes up before multipathd claims
    it. The map's own link, /dev/disk/by-id/dm-uuid-mpath-<wwid>, exists only once the map does:
    systemd-cryptsetup then waits for the map, and never opens a path."""
    if isinstance(backing_dm_uuid, str) and ON_MULTIPATH.match(backing_dm_uuid):
        return f"/dev/disk/by-id/dm-uuid-{backing_dm_uuid}"
    return f"UUID={luks_uuid}"


def build_devices(sysfs, tables, mounts):
    """{name: device} with kind, paths, dm table, slaves/holders and mountpoints."""
    by_dev = {info["dev"]: name for name, info in sysfs.items()}
    devices = {}
    for name, info in sysfs.items():
        dm = info.get("dm")
        table = copy.deepcopy(tables.get(dm["name"], [])) if dm else []
        devices[name] = {
            "name": name,
            "dev": info["dev"],
            "path": f"/dev/mapper/{dm['name']}" if dm else f"/dev/{name}",
            "size_bytes": info.get("size", 0) * 512,
            "kind": _kind(name, info, table),
            "dm_name": dm["name"] if dm else None,
            "dm_uuid": dm["uuid"] if dm else None,
            "suspended": bool(dm and dm.get("suspended")),
            "crypt_type": _crypt_type(dm),
            "slaves": sorted(info.get("slaves", [])),
            "holders": sorted(info.get("holders", [])),
            "partition_of": info.get("partition_of"),
            "wwid": info.get("wwid") or "",
            "table": table,
            "mountpoints": [],
        }
    for mount in mounts:
        name = by_dev.get(mount["dev"])
        if name:
            devices[name]["mountpoints"].append(mount["mountpoint"])
    # A crypt table names its backing device as major:minor: resolve it to a device name.
    for device in devices.values():
        for segment in device["table"]:
            for ref in [segment] + segment.get("devices", []):
                if "device" in ref:
                    ref["device_name"] = by_dev.get(ref["device"]) or _path_name(ref["device"])
    return devices


def _kind(name, info, table):
    if info.get("dm"):
        if any(segment["target"] == "crypt" for segment in table):
            return "crypt"
        if (info["dm"].get("uuid") or "").startswith(LVM_UUID_PREFIX):
            return "lv"
        if (info["dm"].get("uuid") or "").startswith(MULTIPATH_UUID_PREFIX) or any(
            segment["target"] == "multipath" for segment in table
        ):
            return "multipath"
        return "dm"
    if info.get("partition_of"):
        return "partition"
    if name.startswith("loop"):
        return "loop"
    return "disk"


def _crypt_type(dm):
    """LUKS1 / LUKS2 / PLAIN ... from a dm-crypt UUID (CRYPT-<TYPE>-...), None otherwise."""
    uuid = (dm or {}).get("uuid") or ""
    if uuid.startswith(CRYPT_UUID_PREFIX):
        return uuid.split("-")[1] or None
    return None


def luks_uuid_of_crypt(dm_uuid):
    """The LUKS UUID (dashed) of a LUKS mapping's dm UUID (``CRYPT-LUKS2-<32 hex>-<name>``),
    None for any other device."""
    parts = (dm_uuid or "").split("-")
    if len(parts) < 4 or parts[0] != "CRYPT" or not parts[1].startswith("LUKS"):
        return None
    hexa = parts[2].lower()
    if len(hexa) != 32 or any(c not in "0123456789abcdef" for c in hexa):
        return None
    return f"{hexa[:8]}-{hexa[8:12]}-{hexa[12:16]}-{hexa[16:20]}-{hexa[20:]}"


def _path_name(device):
    return device.rsplit("/", 1)[-1] if device.startswith("/dev/") else None


def stack(devices, top):
    """Names from ``top`` down to the disks, depth first, each once."""
    order, todo = [], [top]
    while todo:
        name = todo.pop()
        if name in order or name not in devices:
            continue
        order.append(name)
        todo.extend(reversed(devices[name]["slaves"]))
    return order


def unencrypted_leaves(devices, top):
    """Disks (leaves) that data of ``top`` reaches on a path with no crypt device on it."""
    leaves, todo, seen = set(), [(top, False)], set()
    while todo:
        name, encrypted = todo.pop()
        if (name, encrypted) in seen or name not in devices:
            continue
        seen.add((name, encrypted))
        device = devices[name]
        encrypted = encrypted or device["kind"] == "crypt"
        if not device["slaves"]:
            if not encrypted:
                leaves.add(name)
            continue
        todo.extend((slave, encrypted) for slave in device["slaves"])
    return sorted(leaves)


def direct_paths(devices, top):
    """Disks of the stack that are one path of a multipath LUN used without its map: held by a
    multipath map, or sharing their WWID with another disk (the LUN's other path), and reached
    from a device that is not a multipath map. I/O on one path loses the others' redundancy."""
    found = set()
    for name in stack(devices, top):
        if devices[name]["kind"] == "multipath":
            continue
        for slave in devices[name]["slaves"]:
            disk = devices.get(slave)
            if not disk or disk["kind"] != "disk":
                continue
            held = any(devices.get(h, {}).get("kind") == "multipath" for h in disk["holders"])
            twins = disk["wwid"] and any(
                o["wwid"] == disk["wwid"] and o["name"] != slave and o["kind"] == "disk"
                for o in devices.values()
            )
            if held or twins:
                found.add(slave)
    return sorted(found)


def dm_uuid_or_its_map(devices, name):
    """The dm UUID of the device ``name``, or of the multipath map it is a path of (held by the
    map, or sharing its WWID with one of the map's paths)."""
    device = devices.get(name) or {}
    wwid = device.get("wwid")
    for other in devices.values():
        if other["kind"] == "multipath" and (
            name in other["slaves"]
            or (wwid and any(devices.get(s, {}).get("wwid") == wwid for s in other["slaves"]))
        ):
            return other["dm_uuid"]
    return device.get("dm_uuid")


def encryption_layer(devices, top):
    """'above_lvm', 'below_lvm', 'no_lvm' (crypt, no LV), 'mixed', or None (no crypt at all)."""
    names = stack(devices, top)
    crypts = [n for n in names if devices[n]["kind"] == "crypt"]
    if not crypts:
        return None
    lvs = [n for n in names if devices[n]["kind"] == "lv"]
    if not lvs:
        return "no_lvm"
    layers = set()
    for crypt in crypts:
        below = stack(devices, crypt)
        above_lv = any(devices[n]["kind"] == "lv" for n in below[1:])
        layers.add("above_lvm" if above_lv else "below_lvm")
    return layers.pop() if len(layers) == 1 else "mixed"


def describe(devices, top):
    """What an audit needs to know about one mounted device's stack."""
    names = stack(devices, top)
    return {
        "top": top,
        "devices": names,
        "crypts": [n for n in names if devices[n]["kind"] == "crypt"],
        "lvs": [n for n in names if devices[n]["kind"] == "lv"],
        "disks": [n for n in names if not devices[n]["slaves"]],
        "layer": encryption_layer(devices, top),
        "unencrypted": unencrypted_leaves(devices, top),
        "direct_paths": direct_paths(devices, top),
    }


def backing_device(device):
    """Name of the device a crypt mapping reads from (its first crypt segment's device)."""
    for segment in device["table"]:
        if segment["target"] == "crypt":
            return segment.get("device_name")
    return device["slaves"][0] if device["slaves"] else None
