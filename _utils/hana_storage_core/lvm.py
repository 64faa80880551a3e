"""LVM JSON reports (`lvs`/`pvs --reportformat json --units b --nosuffix`), parsed. Pure code.

The formula asks for exactly these fields (``LVS_FIELDS``, ``PVS_FIELDS``), so a report that
lacks one is malformed input, not a version difference to guess around.
"""

import json
import re

LVS_FIELDS = "lv_name,vg_name,lv_uuid,lv_dm_path,segtype,stripes,stripe_size,seg_start,seg_size,devices"
PVS_FIELDS = "pv_name,vg_name,pv_uuid,dev_size,pv_size"
# Where a state run keeps the LVM reports it read, in its __context__ (Salt gives each run a
# copy of its own): the formula's states open it at each step and empty it whenever a step runs
# a command; the host module reads through it. Outside a state run it does not exist, and each
# report is read afresh.
RUN_REPORTS = "hana_storage.lvm_reports"
_DEVICE = re.compile(r"^(?P<path>[^(),]+)\((?P<extent>\d+)\)$")


# Never read a suspended device while scanning (the read would block until it is resumed); lists
# (devices, tags) joined by commas whatever the site's lvm.conf says (LVM takes one --config).
NO_SUSPENDED = ["--config", 'devices { ignore_suspended_devices = 1 } report { list_item_separator = "," }']


def _report_command(command, fields, *options):
    """``command`` (lvs, pvs) as a JSON report of ``fields`` in bytes, suspended devices unread."""
    return [
        command,
        *NO_SUSPENDED,
        *options,
        "--reportformat",
        "json",
        "--units",
        "b",
        "--nosuffix",
        "-o",
        fields,
    ]


def lvs_command():
    """The `lvs` invocation parse_segments reads (one call for every LV segment on the host)."""
    return _report_command("lvs", LVS_FIELDS, "--segments", "-a")


def pvs_command(every_device=False):
    """The `pvs` invocation parse_pvs reads. ``every_device``: also the devices that are no PV
    (``-a``): every device LVM would scan, after its filters, its devices file and its multipath
    component detection."""
    return _report_command("pvs", PVS_FIELDS, *(["-a"] if every_device else []))


def report_key(devices):
    """What a segments report of this host can differ by, as far as the audit reads it: every
    block device (a PV that went or came back, a map renamed) and each LV's dm table (LVM reloads
    it whenever the LV's segments, stripes or PVs change). While the key is equal, the last report
    still holds; a crypt table's change (a drift of its flags) leaves it equal.

    ``devices``: stack.build_devices' map.
    """
    return json.dumps(
        sorted(
            [name, d["dev"], d["dm_name"], d["dm_uuid"], d["table"] if d["kind"] == "lv" else None]
            for name, d in devices.items()
        ),
        sort_keys=True,
        default=str,
    )


class LvmReportError(ValueError):
    """An LVM report that is not the JSON the formula asked for."""


def parse_segments(text):
    """LV segments: [{lv, vg, uuid, dm_path, segtype, stripes, stripe_size, start, size, devices}]."""
    rows = _rows(text, "seg")
    segments = []
    for index, row in enumerate(rows):
        where = f"segment {index}"
        segments.append(
            {
                "lv": _string(row, "lv_name", where),
                "vg": _string(row, "vg_name", where),
                "uuid": _string(row, "lv_uuid", where),
                "dm_path": _string(row, "lv_dm_path", where),
                "segtype": _string(row, "segtype", where),
                "stripes": _integer(row, "stripes", where),
                "stripe_size": _integer(row, "stripe_size", where),
                "start": _integer(row, "seg_start", where),
                "size": _integer(row, "seg_size", where),
                "devices": _devices(_string(row, "devices", where), where),
            }
        )
    return segments


def parse_pvs(text):
    """PVs: [{pv, vg, uuid, dev_size, pv_size}] (vg is '' for an orphan PV)."""
    rows = _rows(text, "pv")
    return [
        {
            "pv": _string(row, "pv_name", f"pv {index}"),
            "vg": _string(row, "vg_name", f"pv {index}"),
            "uuid": _string(row, "pv_uuid", f"pv {index}"),
            "dev_size": _integer(row, "dev_size", f"pv {index}"),
            "pv_size": _integer(row, "pv_size", f"pv {index}"),
        }
        for index, row in enumerate(rows)
    ]


def _rows(text, kind):
    if not isinstance(text, str | bytes):
        raise LvmReportError(f"an LVM report must be text, got {type(text).__name__}")
    try:
        document = json.loads(text) if text.strip() else {"report": [{kind: []}]}
    except (ValueError, UnicodeDecodeError) as error:
        raise LvmReportError(f"not JSON: {error}") from None
    report = document.get("report") if isinstance(document, dict) else None
    if not isinstance(report, list):
        raise LvmReportError("no 'report' list")
    rows = []
    for part in report:
        if not isinstance(part, dict):
            raise LvmReportError("a 'report' entry is not an object")
        found = part.get(kind, [])
        if not isinstance(found, list) or not all(isinstance(r, dict) for r in found):
            raise LvmReportError(f"'{kind}' is not a list of objects")
        rows.extend(found)
    return rows


def _string(row, key, where):
    value = row.get(key)
    if not isinstance(value, str):
        raise LvmReportError(f"{where}: field {key!r} missing or not a string")
    return value


def _integer(row, key, where):
    value = _string(row, key, where)
    if value == "":
        return 0
    if not (value.isascii() and value.isdigit()) or len(value) > 20:
        raise LvmReportError(f"{where}: field {key!r} is not a number: {value[:40]!r}")
    return int(value)


def _devices(text, where):
    """'/dev/vda(0),/dev/vdb(0)' -> ['/dev/vda', '/dev/vdb']."""
    devices = []
    for part in filter(None, text.split(",")):
        match = _DEVICE.match(part)
        if not match:
            raise LvmReportError(f"{where}: device {part[:60]!r} is not '<path>(<extent>)'")
        devices.append(match["path"])
    return devices


# ---- creation ------------------------------------------------------------------------------------
# Without NO_SUSPENDED: LVM itself refuses a VG or LV name that exists, suspended PVs included, so
# a check that missed one (a multipath reload, a crypt resize) fails closed here. -qq answers no
# to every prompt (a signature found where the LV starts is not wiped: lvcreate stops).


# The tag of the LVs the formula creates (written with the LV's metadata, so no kill leaves an LV
# of the formula's without it): below LVM, an LV on the formula's own LUKS devices without it was
# made by someone else, and what it holds is theirs however fresh the devices under it are.
FORMULA_TAG = "hana_storage_formula"


def lv_tags_command(lv_path):
    """The `lvs` invocation parse_lv_tags reads: the tags of one LV."""
    return _report_command("lvs", "lv_tags", lv_path)


def parse_lv_tags(text):
    """The tags of the one LV of an lv_tags_command report."""
    rows = _rows(text, "lv")
    if len(rows) != 1:
        raise LvmReportError(f"{len(rows)} LVs in a report of one")
    tags = _string(rows[0], "lv_tags", "lv")
    return {tag for tag in tags.split(",") if tag}


def vgcreate_command(vg, pvs):
    """`vgcreate` of ``vg`` over the pillar's ``pvs``."""
    return ["vgcreate", "-qq", vg, *pvs]


def lvcreate_command(lv_path, size, stripes, stripe_bytes, pvs):
    """`lvcreate` of /dev/<vg>/<lv> in the pillar's geometry on the pillar's ``pvs`` only (left
    to itself LVM allocates from any PV of the VG, a LUN the pillar does not name included). A
    size relative to free space (``100%FREE``) counts the free space of those PVs (``%PVS``)."""
    vg, lv = lv_path.split("/")[2:4]
    size = str(size)
    amount = ["--extents", size.replace("%FREE", "%PVS")] if "%" in size else ["--size", size]
    geometry = ["--stripes", str(stripes), "--stripesize", f"{stripe_bytes // 1024}k"] if stripes > 1 else []
    return ["lvcreate", "-qq", "--name", lv, "--addtag", FORMULA_TAG, *amount, *geometry, vg, *pvs]


# ---- growth --------------------------------------------------------------------------------------

PV_ROOM_FIELDS = (
    "pv_name,vg_name,pv_pe_count,pv_pe_alloc_count,pv_allocatable,vg_extent_size,"
    "dev_size,pe_start,pv_mda_count,pv_mda_size"
)


def pv_room_command():
    """The `pvs` invocation parse_pv_room reads: every PV, its VG and its extents."""
    return _report_command("pvs", PV_ROOM_FIELDS)


def parse_pv_room(text):
    """PVs: [{pv, vg, extents, free, allocatable, extent_bytes, device_bytes, pe_start,
    end_metadata_bytes}] (vg '' for an orphan PV, which has no extents yet; free: extents not
    allocated; allocatable: LVM may put new extents there, not after ``pvchange -x n``;
    device_bytes: the device's size as LVM read it, which a PV outgrows until ``pvresize``;
    end_metadata_bytes: a second metadata area at the device's end, where there is one)."""
    rooms = []
    for index, row in enumerate(_rows(text, "pv")):
        where = f"pv {index}"
        extents, allocated = _integer(row, "pv_pe_count", where), _integer(row, "pv_pe_alloc_count", where)
        if allocated > extents:
            raise LvmReportError(f"{where}: {allocated} extents allocated of {extents}")
        vg = _string(row, "vg_name", where)
        extent_bytes = _integer(row, "vg_extent_size", where)
        if extent_bytes <= 0 and vg:  # an orphan PV reports 0: its extents come with a VG
            raise LvmReportError(f"{where}: no extent size")
        rooms.append(
            {
                "pv": _string(row, "pv_name", where),
                "vg": vg,
                "extents": extents,
                "free": extents - allocated,
                "allocatable": _string(row, "pv_allocatable", where) == "allocatable",
                "extent_bytes": extent_bytes,
                "device_bytes": _integer(row, "dev_size", where),
                "pe_start": _integer(row, "pe_start", where),
                "end_metadata_bytes": (
                    _integer(row, "pv_mda_size", where) if _integer(row, "pv_mda_count", where) > 1 else 0
                ),
            }
        )
    return rooms


_SIZE = re.compile(r"^(?P<number>[0-9]+)(?P<unit>[KMGTkmgt]?)$")
_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def size_bytes(size):
    """An LV size of the pillar (``500G``; no unit: MiB, as lvcreate -L reads it) in bytes, or
    None for a size relative to free space or the VG (``100%FREE``, ``90%VG``)."""
    match = _SIZE.match(str(size))
    if not match:
        return None
    return int(match["number"]) * _UNITS[(match["unit"] or "m").lower()]


def extension(lv, stripes, stripe_bytes, size, segments, pvs):
    """How the LV ``vg/lv`` grows to its pillar ``size`` in whole stripes. Pure.

    ``segments``: the LV's (parse_segments), ``pvs``: the PVs it may grow onto (its VG's that the
    pillar gives the volume and LVM may allocate, parse_pv_room). The pillar's
    geometry is the LV's (its first segment): an extension in another one, or over fewer PVs
    than the stripes, would add a tail that spreads HANA's I/O over fewer LUNs than planned.
    Each extension is one segment over ``stripes`` named PVs, those with the most free
    extents. Returns {"action": "none" | "extend" | "refuse", "reason": str,
    "argv": [lvextend argv, ...], "adds_bytes": int}.
    """

    def answer(action, reason, argv=(), adds=0):
        return {"action": action, "reason": reason, "argv": list(argv), "adds_bytes": adds}

    if not segments or not pvs:
        return answer("none", f"{lv} or its PVs are not in the LVM report yet")
    extent = pvs[0]["extent_bytes"]
    current = sum(s["size"] for s in segments)
    wanted = size_bytes(size)
    if wanted is None and str(size) != "100%FREE":
        return answer("none", f"{lv} is sized {size}: only 100%FREE or a size in bytes grows it")
    free = {p["pv"]: p["free"] for p in pvs if p["free"] > 0}
    if wanted is not None:
        if wanted <= current:
            return answer("none", f"{lv} holds {current} bytes, the pillar asks for {size}")
        need = -(-(wanted - current) // extent)  # extents, rounded up to whole stripes below
        need = -(-need // stripes) * stripes
    else:
        need = None
        if len(free) < stripes:
            return answer("none", _left(lv, free, stripes, extent))
    first = segments[0]
    geometry = (first["stripes"], first["stripe_size"] if first["stripes"] > 1 else 0)
    if geometry != (stripes, stripe_bytes if stripes > 1 else 0):
        return answer(
            "refuse",
            f"{lv} has {geometry[0]} stripe(s) of {geometry[1] // 1024} KiB and the pillar asks for "
            f"{stripes} of {stripe_bytes // 1024} KiB: it can only grow in its own geometry (set the "
            f"volume's stripes and stripe_size to the LV's, and give it a multiple of {geometry[0]} devices)",
        )
    argv, added = [], 0
    while len(free) >= stripes and (need is None or added < need):
        chosen = sorted(free, key=lambda pv: (-free[pv], pv))[:stripes]
        per_pv = min(free[pv] for pv in chosen)
        if need is not None:
            per_pv = min(per_pv, (need - added) // stripes)
        argv.append(
            [
                "lvextend",
                "--extents",
                f"+{per_pv * stripes}",
                *(
                    ["--stripes", str(stripes), "--stripesize", f"{stripe_bytes // 1024}k"]
                    if stripes > 1
                    else []
                ),
                lv,
                *chosen,
            ]
        )
        added += per_pv * stripes
        for pv in chosen:
            free[pv] -= per_pv
            if not free[pv]:
                del free[pv]
    if need is not None and added < need:
        return answer(
            "refuse",
            f"{lv} needs {need * extent} more bytes for {size} in {stripes} stripe(s); its VG has room for "
            f"{added * extent} (add devices in multiples of {stripes})",
        )
    return answer(
        "extend", f"{lv} grows by {added * extent} bytes in {stripes} stripe(s)", argv, added * extent
    )


def _left(lv, free, stripes, extent):
    if not free:
        return f"{lv} fills its VG"
    spread = ", ".join(f"{pv} {count * extent} bytes" for pv, count in sorted(free.items()))
    return f"{lv}: free space on {len(free)} PV(s) ({spread}) cannot be striped {stripes} ways: left unused"
