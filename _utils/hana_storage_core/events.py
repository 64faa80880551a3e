"""Beacon and reactor logic that needs no I/O: which volumes a kernel event touches, which findings
appeared or cleared, the audit summary, and the canonical bytes an event signature covers.
"""

import json

from . import limits

# Fields of a finding, in the order events carry them.
FINDING_FIELDS = (
    "rule",
    "severity",
    "volume",
    "mountpoint",
    "device",
    "expected",
    "actual",
    "remediation",
    "message",
)
# Event fields that are not part of what the minion signed: Salt adds "id" and "_stamp".
UNSIGNED_FIELDS = ("sig", "id", "_stamp")
BLOCK_ACTIONS = ("add", "remove", "change", "move", "online", "offline")


def finding_key(finding):
    """What makes a finding the same finding across audits: ``rule|volume|device``."""
    return f"{finding['rule']}|{finding['volume']}|{finding['device']}"


def parse_finding_key(key):
    """``{"rule", "volume", "device"}`` of a finding_key; ValueError for anything else."""
    parts = key.split("|", 2) if isinstance(key, str) else []
    if len(parts) != 3 or not all(parts[:2]):
        raise ValueError(f"not a finding key (rule|volume|device): {key!r}")
    return dict(zip(("rule", "volume", "device"), parts, strict=True))


class OpenFindings:
    """A minion's open findings as the exporter follows them: ``{key: (volume, rule, severity)}``,
    at most ``most``, with the counts per (rule, severity) and per volume kept as findings come
    and go, so that an event costs the same however many are open. A key is kept as
    ``limits.finding_key`` makes it, so each costs at most MAX_FINDING_KEY characters. A volume
    with a finding not kept is failing until the minion's next audit event starts over: what is
    not known to be compliant is not reported compliant."""

    def __init__(self, most=None):
        self.most = limits.MAX_OPEN_FINDINGS if most is None else most
        self.found = {}
        self.by_labels = {}  # (rule, severity) -> open findings
        self.by_volume = {}  # volume -> open findings
        self.unkept = set()  # volumes with a finding not kept (at most ``most``)

    def __len__(self):
        return len(self.found)

    def add(self, key, volume, rule, severity):
        """Keep a finding open (again); False when ``most`` others are open: not kept.
        ValueError for a key or volume that is not a string, or a volume longer than any key."""
        if not isinstance(key, str) or not isinstance(volume, str) or len(volume) > limits.MAX_FINDING_KEY:
            raise ValueError(f"not a finding's key and volume: {str(key)[:100]!r}, {str(volume)[:100]!r}")
        key = limits.finding_key(key)
        if key not in self.found and len(self.found) >= self.most:
            if len(self.unkept) < self.most:
                self.unkept.add(volume)
            return False
        self.remove(key)
        self.found[key] = (volume, rule, severity)
        _count(self.by_labels, (rule, severity), 1)
        _count(self.by_volume, volume, 1)
        return True

    def remove(self, key):
        entry = self.found.pop(limits.finding_key(key), None) if isinstance(key, str) else None
        if entry is not None:
            volume, rule, severity = entry
            _count(self.by_labels, (rule, severity), -1)
            _count(self.by_volume, volume, -1)

    def failing(self, volume):
        return volume in self.by_volume or volume in self.unkept

    def counts(self):
        """{(rule, severity): open findings}."""
        return dict(self.by_labels)


def _count(counts, name, step):
    counts[name] = counts.get(name, 0) + step
    if not counts[name]:
        del counts[name]


def uevent_device(message):
    """Kernel name ('dm-3', 'vde') of a block-device uevent, or None for any other uevent."""
    if message.get("SUBSYSTEM") != "block" or message.get("ACTION") not in BLOCK_ACTIONS:
        return None
    name = message.get("DEVNAME") or (message.get("DEVPATH") or "").rsplit("/", 1)[-1]
    return name.rsplit("/", 1)[-1] or None


def affected_volumes(devices, watched):
    """Volumes whose stack (or pillar disks) contain one of ``devices``.

    ``watched``: {volume: [kernel device names]} from the last audit and the pillar.
    """
    devices = set(devices)
    return sorted(volume for volume, names in watched.items() if devices & set(names))


def mount_view(mounts, mountpoints):
    """{mountpoint: (dev, options)} of the HANA mountpoints: what a mount-table change may alter."""
    view = {}
    for mount in mounts:
        if mount["mountpoint"] in mountpoints:
            view[mount["mountpoint"]] = (mount["dev"], tuple(mount["options"] + mount["super_options"]))
    return view


def changed_mountpoints(before, after):
    return sorted(point for point in set(before) | set(after) if before.get(point) != after.get(point))


def diff_findings(known, findings, scope):
    """(known after, appeared, cleared) for an audit of the volumes in ``scope`` (None = all).

    ``known``: {key: finding} from earlier audits. Findings of volumes outside the scope stay as
    they were; an unchanged finding is neither appeared nor cleared, so never repeated.
    """
    current = {finding_key(f): f for f in findings}
    in_scope = (lambda f: True) if scope is None else (lambda f: f["volume"] in scope)
    kept = {k: f for k, f in known.items() if not in_scope(f)}
    appeared = [f for k, f in current.items() if k not in known]
    cleared = [f for k, f in known.items() if in_scope(f) and k not in current]
    return {**kept, **current}, appeared, cleared


def finding_event(tag, finding, trigger, now):
    return {
        "tag": tag,
        **{k: finding.get(k) for k in FINDING_FIELDS},
        "key": finding_key(finding),
        "trigger": trigger,
        "ts": now,
    }


def audit_event(report, trigger, seconds, now, since):
    """The summary after a full audit: per volume compliant and failing rules, counts per rule.

    ``since``: {finding key: when it was first reported (its violation event's ts)}. The audit
    event repeats it for every open finding, so the master can act on a finding whose violation
    event it never handled (see ``open_findings``). Every open finding must be in it: a time
    made up here would be a new occurrence on each audit, and the master would act again.
    """
    by_rule = {}
    for finding in report["findings"]:
        entry = by_rule.setdefault(finding["rule"], {"severity": finding["severity"], "count": 0})
        entry["count"] += 1
    return {
        "tag": "audit",
        "compliant": report["compliant"],
        "volumes": {
            name: {
                "compliant": v["compliant"],
                "rules": v["rules"],
                "mountpoint": v["mountpoint"],
                **({"in_place": in_place_entry(v["in_place"])} if v.get("in_place") else {}),
            }
            for name, v in report["volumes"].items()
        },
        "findings": len(report["findings"]),
        "by_rule": by_rule,
        "open": {finding_key(f): f["severity"] for f in report["findings"]},
        "since": {finding_key(f): since[finding_key(f)] for f in report["findings"]},
        "trigger": trigger,
        "seconds": round(seconds, 3),
        "ts": now,
    }


def in_place_entry(underway):
    """An encryption in place under way, as the audit event carries it: whether its unit runs,
    and how far it is (percent, seconds left; None before cryptsetup reported)."""
    progress = underway.get("progress") or {}
    return {
        "running": bool(underway.get("running")),
        "percent": progress.get("percent"),
        "eta_s": progress.get("eta_s"),
    }


def in_place_percent(entry):
    """The percent of an audit event's ``in_place`` entry, or None when it is not one (the
    event is signed, but the exporter trusts no shape)."""
    percent = entry.get("percent") if isinstance(entry, dict) else None
    if isinstance(percent, bool) or not isinstance(percent, int) or not 0 <= percent <= 100:
        return None
    return percent


def open_findings(audit):
    """The open findings an audit event lists, each as triage takes a violation: rule, volume,
    device, mountpoint, key, since (the ts of the violation event that first reported it).

    Entries of another shape are skipped: the event is signed, but triage trusts no shape.
    """
    audit = audit if isinstance(audit, dict) else {}
    since, volumes = audit.get("since"), audit.get("volumes")
    volumes = volumes if isinstance(volumes, dict) else {}
    findings = []
    for key, first in sorted(since.items(), key=str) if isinstance(since, dict) else ():
        parts = key.split("|", 2) if isinstance(key, str) else []
        if len(parts) != 3 or isinstance(first, bool) or not isinstance(first, int | float):
            continue
        rule, volume, device = parts
        entry = volumes.get(volume)
        mountpoint = entry.get("mountpoint") if isinstance(entry, dict) else None
        findings.append(
            {
                "rule": rule,
                "volume": volume,
                "device": device,
                "mountpoint": mountpoint,
                "key": key,
                "since": first,
                "message": f"{rule} open on {volume} ({device}), listed by the minion's full audit",
            }
        )
    return findings


def signed_bytes(minion, tag, data):
    """The bytes a minion signs for an event and the master verifies: minion id, tag and data."""
    body = {k: v for k, v in data.items() if k not in UNSIGNED_FIELDS and k != "tag"}
    return json.dumps(
        {"minion": minion, "tag": tag, "data": body}, sort_keys=True, separators=(",", ":"), default=str
    ).encode()


def minion_of_tag(tag):
    """'salt/beacon/<minion>/hana_storage/<event>' -> (minion, event), or (None, None)."""
    parts = tag.split("/")
    if len(parts) == 5 and parts[:2] == ["salt", "beacon"] and parts[3] == "hana_storage" and parts[2]:
        return parts[2], parts[4]
    return None, None


# The identity the master signs its own events as (hana/storage/...): no minion signs as the master,
# because no minion holds the master's private key.
MASTER_SIGNER = "master"
MASTER_TAG_PREFIX = "hana/storage/"
# Fields of a master event outside its signature: the signature itself, and Salt's time stamp.
MASTER_UNSIGNED_FIELDS = ("sig", "_stamp")


def master_signed_bytes(tag, data):
    """The bytes the master signs for an event it fires under ``tag`` (``hana/storage/...``) and
    a consumer verifies with the master's public key: ``signed_bytes`` with the master as sender,
    the whole tag, and every field of the data but ``sig`` and ``_stamp`` (``tag`` and ``id`` too:
    a master event has no field Salt adds but the stamp, so all of them are covered)."""
    body = {k: v for k, v in data.items() if k not in MASTER_UNSIGNED_FIELDS}
    return signed_bytes(MASTER_SIGNER, tag, {"fields": body})
