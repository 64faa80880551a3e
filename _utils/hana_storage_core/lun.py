"""A LUN grown in place (a SAN LUN resized, a cloud volume made larger): what carries its new
size up to its LVM PV. Pure code; the host module reads the facts, the state runs the steps.

The stack under a PV, bottom up: the LUN's paths (several where multipath is used), the
multipath map over them, below LVM the open LUKS device on the map or disk, then the PV. Each
layer keeps its old size until told: ``multipathd resize map``, ``cryptsetup resize``,
``pvresize``, in that order. The LV grows afterwards, in its own stripes (lvm.extension), only
where every stripe's PV has the room.
"""


class LunError(ValueError):
    """The facts say the stack cannot be grown as it is: the message names what to do."""


MIB = 1 << 20


def pv_extents_at(pv, device_bytes):
    """The extents the PV ``pv`` (lvm.parse_pv_room) holds once ``pvresize`` fits it to a
    device of ``device_bytes``: everything past its first extent (``pe_start``), less a second
    metadata area at the device's end where the PV has one, in whole extents. The report gives
    the smaller area's size; the one at the end is counted as whole MiB, so that a PV is never
    promised an extent pvresize would not make (which would plan pvresize on every apply)."""
    end = -(-pv["end_metadata_bytes"] // MIB) * MIB
    usable = device_bytes - pv["pe_start"] - end
    return max(usable // pv["extent_bytes"], 0) if pv["extent_bytes"] > 0 else 0


def plan(facts):
    """The steps that carry a LUN's size up to its PV. Returns {"steps": [{"step": "map" |
    "crypt" | "pv", "from": bytes (extents for "pv"), "to": ...}], "adds_extents": int}; raises
    LunError where growing would be wrong (paths of one LUN disagree, a path whose size cannot
    be read while the others grew, a layer larger than what is under it: a LUN that shrank, a
    LUKS size cryptsetup would refuse).

    ``facts``: {"device": the pillar's device, "device_bytes": its size now,
    "paths": {kernel name: bytes} (a multipath map's paths, else {}), "map": its dm name,
    "crypt": None or {"name", "bytes", "offset_bytes", "sector_bytes"} (below LVM: the open LUKS
    device on it; sector_bytes: its encryption sector size, 512 if not given),
    "pv": None or the PV's lvm.parse_pv_room entry (None: not a PV of a VG yet)}.
    """
    device, size, steps = facts["device"], facts["device_bytes"], []
    if not size:
        raise LunError(f"the size of {device} cannot be read")
    paths = facts.get("paths") or {}
    # a path whose size reads 0 (READ CAPACITY failed as the path went down): its size is unknown
    unread = sorted(path for path, bytes_ in paths.items() if not bytes_)
    if paths:
        sizes = {bytes_ for bytes_ in paths.values() if bytes_}
        if not sizes:
            raise LunError(f"the size of no path of {device} can be read ({', '.join(unread)})")
        if len(sizes) > 1:
            seen = ", ".join(f"{path} {paths[path]} bytes" for path in sorted(paths))
            raise LunError(
                f"the paths of {device} differ in size ({seen}): rescan each path of the LUN "
                "(echo 1 > /sys/block/<path>/device/rescan) before it can grow"
            )
        grown = sizes.pop()
        if grown < size:
            raise LunError(
                f"the paths of {device} are smaller than its map ({grown} < {size} bytes): a LUN that shrank"
            )
        if grown > size and unread:
            raise LunError(
                f"the size of {', '.join(unread)} (a path of {device}) cannot be read (a failed path?): "
                "restore or remove it, and rescan it, before the LUN can grow"
            )
        if grown > size:
            steps.append({"step": "map", "from": size, "to": grown})
            size = grown
    crypt = facts.get("crypt")
    if crypt:
        fits = size - crypt["offset_bytes"]
        if crypt["bytes"] > fits:
            raise LunError(
                f"/dev/mapper/{crypt['name']} ({crypt['bytes']} bytes) is larger than {device} "
                f"leaves it ({fits} bytes): a LUN that shrank"
            )
        if crypt["bytes"] < fits:
            sector = crypt.get("sector_bytes") or 512
            if fits % sector:
                raise LunError(
                    f"/dev/mapper/{crypt['name']} would span {fits} bytes of {device}, no multiple of its "
                    f"{sector}-byte LUKS sectors (cryptsetup resize refuses that): grow the LUN to a "
                    f"multiple of {sector} bytes"
                )
            steps.append({"step": "crypt", "from": crypt["bytes"], "to": fits})
        size = fits
    pv, adds = facts.get("pv"), 0
    if pv and pv["vg"]:
        if pv["pe_start"] + pv["extents"] * pv["extent_bytes"] > size:
            raise LunError(
                f"the {pv['extents']} extents of the PV {pv['pv']} end past the {size} bytes under it: "
                "a LUN that shrank"
            )
        after = pv_extents_at(pv, size)
        if after > pv["extents"]:
            steps.append({"step": "pv", "from": pv["extents"], "to": after})
            adds = after - pv["extents"]
    return {"steps": steps, "adds_extents": adds}
