"""The data-loss guard: may the formula build on a device, must it wipe it first, or must it stop?
Pure code: decides from a probe the execution module made (``hana_storage.probe``).

A probe is ``{"device", "exists", "block", "signatures": [{"type", "usage"}], "pttype",
"pv_vg", "luks": {"version", "uuid", "keyslots"} | None, "key_opens": bool | None, "holders": [dm names],
"mountpoints": [...], "nonzero_head": bool, "xfs": {...} | None}``.

Verdicts: ``use`` (blank, or already what the plan builds there), ``wipe`` (foreign, but the
pillar allows formatting this device) and ``refuse`` (foreign data; nothing is touched).
"""


def _verdict(device, verdict, reason):
    return {"device": device, "verdict": verdict, "reason": reason}


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
        return _verdict(device, "use", _ours_reason(volume, probe))
    if probe.get("mountpoints") or foreign.startswith("in use"):
        return _verdict(device, "refuse", foreign)  # never wipe what is live, allowed or not
    if device in volume["may_format"]:
        return _verdict(device, "wipe", f"{foreign}; allowed by allow_format")
    return _verdict(device, "refuse", foreign)


def _foreign_disk(volume, probe):
    """None when the disk is blank or what the plan builds on it; else why it is foreign."""
    if not probe.get("exists"):
        return "does not exist"
    if not probe.get("block"):
        return "is not a block device"
    if probe.get("mountpoints"):
        return f"in use: mounted at {', '.join(probe['mountpoints'])}"
    above = volume["encryption"] == "above_lvm"
    own_holders = {f"{volume['lv_dm_name']}"} if above else {c["name"] for c in volume["crypt"]}
    alien = [h for h in probe.get("holders", []) if h not in own_holders]
    if alien:
        return f"in use by {', '.join(alien)}"
    if probe.get("pttype"):
        return f"carries a {probe['pttype']} partition table"
    types = [s["type"] for s in probe.get("signatures", [])]
    if not types:
        return (
            "holds data without a known signature (non-zero first MiB)" if probe.get("nonzero_head") else None
        )
    if above and types == ["LVM2_member"]:
        if probe.get("pv_vg") in ("", volume["vg"]):  # orphan PV: an earlier, interrupted run
            return None
        return f"is a PV of volume group {probe.get('pv_vg')!r}"
    if not above and types == ["crypto_LUKS"]:
        if probe.get("key_opens") or probe.get("holders"):  # holders: only our own mapping, see above
            return None
        if unfinished_luks(probe):
            return None
        return "is LUKS that the volume's key cannot open"
    return f"carries a {describe_signatures(probe)} signature"


def _ours_reason(volume, probe):
    if not probe.get("signatures") and not probe.get("pttype"):
        return "blank"
    if volume["encryption"] == "above_lvm":
        return f"already a PV of {probe.get('pv_vg') or 'no volume group yet'}"
    if probe.get("holders"):
        return f"already LUKS, open as {', '.join(probe['holders'])}"
    if unfinished_luks(probe):
        return UNFINISHED_LUKS
    return "already LUKS, opened by the volume's key"


UNFINISHED_LUKS = (
    "an interrupted luksFormat left a LUKS header with no keyslot: no key opens it, it is formatted again"
)


def unfinished_luks(probe):
    """A LUKS header without a single keyslot: what luksFormat leaves when killed between writing
    the header and adding the key. Nobody can decrypt anything behind it: nothing can be lost."""
    luks = probe.get("luks") or {}
    return luks.get("keyslots") == 0 and not probe.get("holders") and not probe.get("key_opens")


def refusal_summary(verdicts):
    refused = [v for v in verdicts if v["verdict"] == "refuse"]
    return "; ".join(f"{v['device']} {v['reason']}" for v in refused)


def layer_verdict(layer, probe, may_wipe, own_holders=()):
    """An inner device the plan creates itself: 'luks' (the LV above LVM) or 'xfs' (the fs device).

    ``own_holders``: the device-mapper names the plan puts on top of it (its crypt mapping).
    Returns ``use`` (already done), ``create`` (blank: format it), ``wipe`` or ``refuse``.
    """
    device = probe["device"]
    types = [s["type"] for s in probe.get("signatures", [])]
    alien = [h for h in probe.get("holders", []) if h not in own_holders]
    if layer == "luks" and (probe.get("mountpoints") or alien):
        where = probe.get("mountpoints") or alien
        return _verdict(device, "refuse", f"in use by {', '.join(where)}")
    if layer == "luks" and types == ["crypto_LUKS"]:
        if probe.get("holders"):
            return _verdict(device, "use", f"already LUKS, open as {', '.join(probe['holders'])}")
        if probe.get("key_opens"):
            return _verdict(device, "use", "already LUKS, opened by the volume's key")
        if unfinished_luks(probe):
            return _verdict(device, "create", UNFINISHED_LUKS)
        foreign = "is LUKS that the volume's key cannot open"
    elif layer == "xfs" and types == ["xfs"]:
        if (probe.get("xfs") or {}).get("inprogress"):
            return _verdict(device, "create", "an interrupted mkfs.xfs left an unfinished filesystem")
        return _verdict(device, "use", "already XFS")
    elif not types and not probe.get("pttype"):
        return _verdict(device, "create", "blank")
    else:
        foreign = f"carries a {describe_signatures(probe)} signature"
    if may_wipe:
        return _verdict(device, "wipe", f"{foreign}; every device of the volume is allowed to be formatted")
    return _verdict(device, "refuse", foreign)
