"""LVM JSON reports (`lvs`/`pvs --reportformat json --units b --nosuffix`), parsed. Pure code.

The formula asks for exactly these fields (``LVS_FIELDS``, ``PVS_FIELDS``), so a report that
lacks one is malformed input, not a version difference to guess around.
"""

import json
import re

LVS_FIELDS = "lv_name,vg_name,lv_uuid,lv_dm_path,segtype,stripes,stripe_size,seg_start,seg_size,devices"
PVS_FIELDS = "pv_name,vg_name,pv_uuid,dev_size,pv_size"
_DEVICE = re.compile(r"^(?P<path>[^(),]+)\((?P<extent>\d+)\)$")


# never read a suspended device while scanning: the read would block until it is resumed
NO_SUSPENDED = ["--config", "devices { ignore_suspended_devices = 1 }"]


def lvs_command():
    """The `lvs` invocation parse_segments reads (one call for every LV segment on the host)."""
    return [
        "lvs",
        *NO_SUSPENDED,
        "--reportformat",
        "json",
        "--units",
        "b",
        "--nosuffix",
        "--segments",
        "-a",
        "-o",
        LVS_FIELDS,
    ]


def pvs_command(every_device=False):
    """The `pvs` invocation parse_pvs reads. ``every_device``: also the devices that are no PV
    (``-a``): every device LVM would scan, after its filters, its devices file and its multipath
    component detection."""
    every = ["-a"] if every_device else []
    return [
        "pvs",
        *NO_SUSPENDED,
        *every,
        "--reportformat",
        "json",
        "--units",
        "b",
        "--nosuffix",
        "-o",
        PVS_FIELDS,
    ]


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
