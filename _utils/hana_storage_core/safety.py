"""The data-loss guard: may the formula build on a device, must it wipe it first, or must it stop?
Pure code: decides from a probe the execution module made (``hana_storage.probe``).

A probe is ``{"device", "exists", "block", "signatures": [{"type", "usage"}], "pttype",
"pv_vg", "luks": {"version", "uuid", "keyslots"} | None, "key_opens": bool | None,
"key_error": str | None, "holders": [dm names], "mountpoints": [...], "data_at": int | None,
"xfs": {...} | None, "lvm_sees_paths": [paths of a multipath map that LVM scans] | None (not known)}``.
``pv_vg`` of a device with an LVM label is its VG as `pvs` lists it ('' for an orphan PV), None
when LVM did not list it. ``key_opens`` is False only when cryptsetup said "no key opens it" (its
exit code 2); a key test that failed for any other reason (out of memory, busy, ...) leaves it
None and says why in ``key_error``. ``data_at`` is the first byte offset where the sampled areas
(start, LUKS2/LVM secondary areas, middle, end, and a spread of windows) hold a non-zero byte.

A verdict is ``{"device", "verdict", "code", "reason"}``: ``verdict`` is ``use`` (blank, or
already what the plan builds there), ``create`` (an inner layer to format), ``wipe`` (foreign,
but the pillar allows formatting this device) or ``refuse`` (nothing is touched). Decisions are
made on ``code``; ``reason`` is for people.
"""

from .inplace import reencryption_stack

# Codes a wipe can never follow, whatever allow_format says: the device is live, absent, or
# what is on it is not known (a key test that failed is not "the key does not open it"; a PV
# whose volume group LVM did not report may be one of this volume's own).
NEVER_WIPE = frozenset(
    {
        "missing",
        "not_block",
        "mounted",
        "held",
        "key_test_failed",
        "key_not_tested",
        "lvm_sees_paths",
        "pv_vg_unknown",
    }
)
PV_VG_UNKNOWN = (
    "carries an LVM label, but LVM did not list it as a PV (pvs failed, the device was suspended "
    "while LVM read, or LVM's filter or devices file hides it): which volume group it belongs to "
    "is not known, so nothing is written. Run again; a PV LVM hides on purpose needs LVM to see "
    "it (lvmdevices --adddev, the filter) or a wipe by hand"
)


def lvm_sees_paths_reason(paths):
    """Why a multipath map LVM also reaches through its paths cannot carry a PV, and the fix."""
    seen = f"paths ({', '.join(paths)})" if paths else "paths (pvs -a could not tell which it scans)"
    return (
        f"is a multipath map whose {seen} LVM scans too: it would see every PV on the LUN twice and "
        "refuse the volume group. Let LVM see only the maps first: in lvm.conf "
        '`devices { global_filter = [ "a|^/dev/mapper/mpath|", "r|.*|" ] }`, or '
        "multipath_component_detection = 1 with the LUN in /etc/multipath/wwids, or on RHEL 9 the "
        "devices file (lvmdevices --adddev /dev/mapper/<map>)"
    )


def _with_reencryption(crypt_names, probe):
    """The plan's crypt mappings that may hold the probed device, and, while its LUKS2 header
    says it is re-encrypted (cryptsetup's own mark, which a name cannot forge), the hotzone and
    overlay devices cryptsetup puts under them on it. Only crypt mappings get such a stack: a
    holder named after an LV is someone else's."""
    names = set(crypt_names)
    if (probe.get("luks") or {}).get("reencryption"):
        names = names.union(*(reencryption_stack(name) for name in crypt_names))
    return names


def _verdict(device, verdict, code, reason):
    return {"device": device, "verdict": verdict, "code": code, "reason": reason}


def describe_signatures(probe):
    parts = [s["type"] for s in probe.get("signatures", [])]
    if probe.get("pttype"):
        parts.append(f"{probe['pttype']} partition table")
    return ", ".join(parts)


def disk_verdict(volume, probe):
    """A pillar device of ``volume``: blank, or already ours, or foreign."""
    device = probe["device"]
    foreign = _foreign_disk(volume, probe)
    if foreign is None:
        return _verdict(device, "use", *_ours(volume, probe))
    code, reason = foreign
    if code not in NEVER_WIPE and device in volume["may_format"]:
        return _verdict(device, "wipe", code, f"{reason}; allowed by allow_format")
    return _verdict(device, "refuse", code, reason)


def _foreign_disk(volume, probe):
    """None when the disk is blank or what the plan builds on it; else (code, why it is foreign)."""
    if not probe.get("exists"):
        return "missing", "does not exist"
    if not probe.get("block"):
        return "not_block", "is not a block device"
    if probe.get("mountpoints"):
        return "mounted", f"in use: mounted at {', '.join(probe['mountpoints'])}"
    above = volume["encryption"] == "above_lvm"
    own_holders = (
        {volume["lv_dm_name"]} if above else _with_reencryption([c["name"] for c in volume["crypt"]], probe)
    )
    alien = [h for h in probe.get("holders", []) if h not in own_holders]
    if alien:
        return "held", f"in use by {', '.join(alien)}"
    if above and probe.get("lvm_sees_paths", []) != []:  # None: not known, and unknown is not fine
        return "lvm_sees_paths", lvm_sees_paths_reason(probe.get("lvm_sees_paths"))
    if probe.get("pttype"):
        return "partition_table", f"carries a {probe['pttype']} partition table"
    types = [s["type"] for s in probe.get("signatures", [])]
    if not types:
        return _unknown_data(probe)
    if above and types == ["LVM2_member"]:
        if probe.get("pv_vg") in ("", volume["vg"]):  # orphan PV: an earlier, interrupted run
            return None
        if probe.get("pv_vg") is None:
            return "pv_vg_unknown", PV_VG_UNKNOWN
        return "foreign_pv", f"is a PV of volume group {probe.get('pv_vg')!r}"
    if not above and types == ["crypto_LUKS"]:
        if probe.get("holders"):  # only our own mapping, see above
            return None
        return _luks_key_verdict(probe)
    return "foreign_signature", f"carries a {describe_signatures(probe)} signature"


def _unknown_data(probe):
    """None for a device whose sampled areas are all zero; else the code and where data sits."""
    if probe.get("data_at") is None:
        return None
    return (
        "unknown_data",
        f"holds data without a known signature (non-zero bytes at offset {probe['data_at']})",
    )


def _luks_key_verdict(probe):
    """None when a closed LUKS device is the volume's: its key opens it, or it is a luksFormat of
    this formula's that was killed before its keyslot."""
    if probe.get("key_opens"):
        return None
    if unfinished_luks(probe):
        return None
    if (probe.get("luks") or {}).get("keyslots") == 0:
        return "damaged_luks", DAMAGED_LUKS
    if probe.get("key_error"):
        return "key_test_failed", f"is LUKS, and testing the volume's key on it failed: {probe['key_error']}"
    if probe.get("key_opens") is None:
        return "key_not_tested", "is LUKS; the volume's key has not been tried on it (no key file yet)"
    return "foreign_luks", "is LUKS that the volume's key cannot open"


def _ours(volume, probe):
    """(code, reason) of a disk the guard lets the plan use."""
    if not probe.get("signatures") and not probe.get("pttype"):
        return "blank", "blank"
    if volume["encryption"] == "above_lvm":
        return "own_pv", f"already a PV of {probe.get('pv_vg') or 'no volume group yet'}"
    if probe.get("holders"):
        return "own_luks_open", f"already LUKS, open as {', '.join(probe['holders'])}"
    if unfinished_luks(probe) and not probe.get("key_opens"):
        return "unfinished_luks", UNFINISHED_LUKS
    return "own_luks", "already LUKS, opened by the volume's key"


UNFINISHED_LUKS = (
    "an interrupted luksFormat of this formula's left a LUKS header with no keyslot: no key opens it, "
    "it is formatted again"
)
DAMAGED_LUKS = (
    "is LUKS with no keyslot left, and not one this formula began (luksErase, a damaged or overwritten "
    "header): the data behind it is still there, and a header backup restores it "
    "(cryptsetup luksHeaderRestore --header-backup-file ...)"
)


def unfinished_luks(probe):
    """A LUKS header without a single keyslot that this formula began: what its luksFormat leaves
    when killed between writing the header and adding the key, or while writing the header
    itself (no copy readable: the primary cut short, the secondary not written yet; ``luks.error``,
    see luks.torn_format_uuid). ``luks.format_began``: the probe found the
    mark the formula leaves, by the UUID it gives the header, before it runs luksFormat, and
    removes once luksFormat returned. Nobody can decrypt anything behind it. Any other header
    without a keyslot, or unreadable (luksErase, a damaged or overwritten header), is damage,
    never blank: the volume key is gone, a backup brings it back."""
    luks = probe.get("luks") or {}
    return (
        (luks.get("keyslots") == 0 or bool(luks.get("error")))
        and bool(luks.get("format_began"))
        and not probe.get("holders")
        and not probe.get("key_opens")
    )


def refusal_summary(verdicts):
    refused = [v for v in verdicts if v["verdict"] == "refuse"]
    return "; ".join(f"{v['device']} {v['reason']}" for v in refused)


def layer_verdict(layer, probe, may_wipe, own_holders=(), own_vg=None, created_now=False):
    """An inner device the plan creates itself.

    ``layer``: ``luks`` (the LV above LVM), ``pv`` (an opened LUKS device below LVM, before
    pvcreate) or ``xfs`` (the filesystem device). ``own_holders``: the device-mapper names the
    plan puts on top of it; ``own_vg``: the volume's VG (``pv``); ``created_now``: this apply
    created the device (an LV that was not there before holds nothing of anyone's).

    Returns ``use`` (already done), ``create`` (format it), ``wipe`` or ``refuse``.
    """
    device = probe["device"]
    types = [s["type"] for s in probe.get("signatures", [])]
    own = _with_reencryption(own_holders, probe) if layer == "luks" else set(own_holders)
    alien = [h for h in probe.get("holders", []) if h not in own]
    finished_xfs = types == ["xfs"] and not (probe.get("xfs") or {}).get("inprogress")
    # live: never formatted or wiped, whatever the pillar allows; only an XFS already made (and
    # mounted by the formula, or by hand) is used as it is
    if probe.get("mountpoints") and not (layer == "xfs" and finished_xfs):
        return _verdict(device, "refuse", "mounted", f"is mounted at {', '.join(probe['mountpoints'])}")
    if alien:
        return _verdict(device, "refuse", "held", f"is in use by {', '.join(alien)}")
    blank = not types and not probe.get("pttype")
    if layer in ("pv", "xfs") and blank:
        # No signature is not "blank" here either: an opened LUKS device reads noise where nothing
        # was written, and a filesystem whose magic was erased reads the same to blkid. Only noise
        # the formula made (a LUKS device it formatted with nothing inside yet, an LV this apply
        # created over such devices) or areas that read zero are blank.
        if created_now:
            return _verdict(device, "create", "created_now", "blank (created by this apply)")
        if probe.get("payload_unused"):
            return _verdict(
                device, "create", "unused_luks", "blank (a LUKS device this formula formatted, unused since)"
            )
        unknown = _unknown_data(probe)
        if unknown is None:
            return _verdict(device, "create", "blank", "blank")
        code, foreign = unknown
        if layer == "pv" or not may_wipe:  # pvcreate has no leave to wipe: a PV is made on blank only
            return _verdict(device, "refuse", code, foreign)
        return _verdict(
            device, "wipe", code, f"{foreign}; every device of the volume is allowed to be formatted"
        )
    if layer == "pv":
        # Inside a LUKS device the key opens: what a former layout or a re-used key left there is
        # someone's data. pvcreate would wipe it, so only blank or our own VG's PV goes on.
        if types == ["LVM2_member"] and probe.get("pv_vg") in ("", own_vg):
            return _verdict(device, "use", "own_pv", f"already a PV of {probe.get('pv_vg') or 'no VG yet'}")
        if types == ["LVM2_member"] and probe.get("pv_vg") is None:
            return _verdict(device, "refuse", "pv_vg_unknown", PV_VG_UNKNOWN)
        what = f"is a PV of volume group {probe.get('pv_vg')!r}" if types == ["LVM2_member"] else None
        return _verdict(
            device, "refuse", "foreign_signature", what or f"carries a {describe_signatures(probe)} signature"
        )
    if layer == "luks" and types == ["crypto_LUKS"]:
        if probe.get("holders"):
            return _verdict(
                device, "use", "own_luks_open", f"already LUKS, open as {', '.join(probe['holders'])}"
            )
        if probe.get("key_opens"):
            return _verdict(device, "use", "own_luks", "already LUKS, opened by the volume's key")
        if unfinished_luks(probe):
            return _verdict(device, "create", "unfinished_luks", UNFINISHED_LUKS)
        code, foreign = _luks_key_verdict(probe)
        if code in NEVER_WIPE:
            return _verdict(device, "refuse", code, foreign)
    elif layer == "luks" and blank:
        # No signature is not "blank": plain dm-crypt, LUKS with a detached header or a damaged
        # LUKS1 header show none. Only an LV this apply created, or one whose sampled areas
        # read zero, is formatted without leave.
        if created_now:
            return _verdict(device, "create", "created_now", "blank (created by this apply)")
        unknown = _unknown_data(probe)
        if unknown is None:
            return _verdict(device, "create", "blank", "blank")
        code, foreign = unknown
    elif layer == "xfs" and types == ["xfs"]:
        if (probe.get("xfs") or {}).get("inprogress"):
            return _verdict(
                device, "create", "interrupted_mkfs", "an interrupted mkfs.xfs left an unfinished filesystem"
            )
        return _verdict(device, "use", "own_xfs", "already XFS")
    else:
        code, foreign = "foreign_signature", f"carries a {describe_signatures(probe)} signature"
    if may_wipe:
        return _verdict(
            device, "wipe", code, f"{foreign}; every device of the volume is allowed to be formatted"
        )
    return _verdict(device, "refuse", code, foreign)
