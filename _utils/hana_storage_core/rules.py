"""Compliance rules with stable IDs: the normalised plan against facts about the host. Pure code.

``audit(plan, facts)`` -> {"compliant", "findings", "volumes"}. ``facts`` is gathered by the
execution module: the device tree (stack.build_devices), mounts, LUKS header summaries and XFS
superblocks by device name, LVM segments, crypttab, fstab and key file stats. A fact that could
not be gathered is ``{"error": "..."}`` and the rule that needs it says so.
"""

import datetime
from typing import NamedTuple

from . import controls, inplace, kdf, reencrypt, stack, tab, xfs


class Fix(NamedTuple):
    """How an auto rule is repaired: the formula's own state, with arguments read from the plan.

    ``per``: what a finding of the rule names - ``crypt`` (one crypt device of the volume, its
    ``/dev/mapper`` path), ``volume`` or ``key`` (the volume's key file). ``args``: the state's
    keyword arguments, each a dotted path into the plan's ``volume``, its ``crypt`` entry or its
    ``luks`` policy. ``needs``: a fact of the volume's audit summary that must be true first.
    """

    state: str
    per: str
    args: dict
    needs: str = ""


class Rule(NamedTuple):
    """A rule: its severity, what fails, its fix (None: manual, an admin decides), why it matters
    (``rationale``) and the controls it gives evidence for (``controls``: keys of
    controls.CONTROLS). The SCAP data stream, the evidence report and the README read them here."""

    severity: str
    title: str
    fix: Fix | None = None
    rationale: str = ""
    controls: tuple = ()

    @property
    def remediation(self):
        return "auto" if self.fix else "manual"


CRYPT_FLAGS = Fix(
    "hana_storage.luks_flags",
    "crypt",
    {"name": "crypt.name", "device": "crypt.device", "key_file": "volume.key.file", "flags": "luks.flags"},
)
CRYPTTAB = Fix(
    "hana_storage.crypttab_present",
    "crypt",
    {
        "name": "crypt.name",
        "device": "crypt.device",
        "key_file": "volume.key.crypttab",
        "options": "volume.crypttab_options",
    },
)
MOUNT = Fix(
    "hana_storage.mounted",
    "volume",
    {
        "name": "volume.mountpoint",
        "device": "volume.fs_device",
        "options": "volume.mount_options",
        "fstab_options": "volume.fstab_options",
    },
    needs="mounted",  # a volume that is not mounted is HANA-MOUNT-001, which is manual
)
FS_GROWN = Fix(
    "hana_storage.fs_grown",
    "volume",
    {"name": "volume.mountpoint", "device": "volume.fs_device"},
    needs="mounted",  # xfs_growfs grows a mounted filesystem only
)
CLEVIS_BINDING = Fix(
    "hana_storage.clevis_bound",
    "crypt",
    {
        "name": "crypt.device",
        "key_file": "volume.key.file",
        "policy": "volume.key.clevis",
        "header_backup": "crypt.header_backup",
        "previous_key_file": "volume.key.previous.file",
    },
)
HEADER_BACKUP = Fix(
    "hana_storage.header_backed_up",
    "crypt",
    {
        "name": "crypt.device",
        "backup": "crypt.header_backup",
        "key_file": "volume.key.file",
        "previous_key_file": "volume.key.previous.file",
        "policy": "volume.key.clevis",
    },
)
KEY_FILE = Fix(
    "hana_storage.key_present",
    "key",
    {"name": "volume.key.file", "source": "volume.key.store", "pillar_path": "volume.key.pillar"},
)

AT_REST, KEYS, ENCRYPTED = controls.AT_REST, controls.KEYS, controls.ENCRYPTED_PARTITIONS
STORAGE = ("SAP-STORAGE", "CM-6")

RULES = {
    "HANA-ENC-001": Rule(
        "critical",
        "a HANA mount is backed by a stack with no crypt target",
        rationale="Data of the volume reaches a disk in the clear: a disk taken out of the array, or a "
        "snapshot of the LUN, gives it away.",
        controls=(*AT_REST, *ENCRYPTED),
    ),
    "HANA-ENC-002": Rule(
        "high",
        "LUKS version is not 2",
        rationale="LUKS1 keeps no persistent dm-crypt flags and protects its keyslots with PBKDF2 only.",
        controls=(*AT_REST, "SC-13"),
    ),
    "HANA-ENC-003": Rule(
        "critical",
        "cipher differs from policy",
        rationale="A cipher other than the policy's (AES-XTS) may be weaker or unapproved.",
        controls=(*AT_REST, "SC-13"),
    ),
    "HANA-ENC-004": Rule(
        "high",
        "key size below policy",
        rationale="A shorter key than the policy's gives less protection than was decided.",
        controls=(*AT_REST, "SC-13", "PCI-3.7.1"),
    ),
    "HANA-ENC-005": Rule(
        "high",
        "crypt mapping with no (readable) LUKS header",
        rationale="Plain dm-crypt, or LUKS whose header cannot be read, has no keyslots to manage: its key "
        "cannot be rotated, backed up or audited.",
        controls=(*AT_REST, *KEYS),
    ),
    "HANA-ENC-006": Rule(
        "medium",
        "keyslot KDF weaker than policy",
        rationale="A keyslot with a cheap key derivation makes guessing its passphrase cheaper.",
        controls=("SC-13", "IA-5", "PCI-3.6.1"),
    ),
    "HANA-ENC-007": Rule(
        "high",
        "one LUKS2 header copy is damaged (degraded)",
        rationale="LUKS2 keeps two copies of its header; with one damaged, the next damage loses the volume key "
        "and the data.",
        controls=("SC-28", "CP-9", "SI-7"),
    ),
    "HANA-ENC-008": Rule(
        "high",
        "keyslot KDF that FIPS mode refuses",
        rationale="A host in FIPS mode (or about to run in it: compliance:fips) opens PBKDF2-SHA256 keyslots only: "
        "an argon2 keyslot no longer unlocks the volume at boot.",
        controls=("SC-13", "CM-6"),
    ),
    "HANA-PERF-001": Rule(
        "medium",
        "LUKS sector size differs from policy",
        rationale="512-byte encryption sectors cost HANA's large I/O several times the work of 4 KiB ones.",
        controls=STORAGE,
    ),
    "HANA-PERF-002": Rule(
        "medium",
        "active dm-crypt flags differ from policy",
        CRYPT_FLAGS,
        rationale="Without no_read_workqueue and no_write_workqueue every I/O waits for dm-crypt's work queues: "
        "HANA's log writes slow down.",
        controls=(*STORAGE, "SAP-HCMT"),
    ),
    "HANA-PERF-003": Rule(
        "low",
        "persistent LUKS2 header flags differ from policy",
        CRYPT_FLAGS,
        rationale="Flags not stored in the header are lost at the next open, after a reboot.",
        controls=STORAGE,
    ),
    "HANA-PERF-004": Rule(
        "medium",
        "allow_discards differs from policy",
        CRYPT_FLAGS,
        rationale="Discards through dm-crypt reveal which blocks are free, where the policy says they must not.",
        controls=("SC-28", "CM-6"),
    ),
    "HANA-PERF-005": Rule(
        "medium",
        "the kernel's xts(aes) driver is a generic one, not a hardware-accelerated one",
        rationale="Without AES instructions encryption costs several times the CPU, and HANA's I/O waits for it.",
        controls=(*STORAGE, "SAP-HCMT"),
    ),
    "HANA-LAYOUT-001": Rule(
        "medium",
        "LV stripe count or stripe size differs from pillar",
        rationale="A volume striped otherwise than sized spreads HANA's I/O over fewer LUNs than planned.",
        controls=STORAGE,
    ),
    "HANA-LAYOUT-002": Rule(
        "medium",
        "encryption at the other layer than the pillar says",
        rationale="The layout differs from the design that was approved and that key management expects.",
        controls=("SC-28", "CM-6"),
    ),
    "HANA-LAYOUT-003": Rule(
        "low",
        "XFS sunit/swidth do not match the stripe geometry",
        rationale="An XFS not aligned to the stripe splits writes across stripes.",
        controls=(*STORAGE, "SAP-405827"),
    ),
    "HANA-LAYOUT-004": Rule(
        "high",
        "a device of the stack is missing or suspended",
        rationale="I/O to the volume stalls or fails.",
        controls=STORAGE,
    ),
    "HANA-LAYOUT-005": Rule(
        "high",
        "a LUKS device or PV sits on one path of a multipath LUN, not on its map",
        rationale="When that path fails, I/O fails although the LUN is still reachable over the others.",
        controls=STORAGE,
    ),
    "HANA-LAYOUT-006": Rule(
        "medium",
        "the pillar names a device by a name that can change across boots",
        rationale="A kernel name may name another disk after a reboot: the formula would act on the wrong one.",
        controls=("CM-6",),
    ),
    "HANA-LAYOUT-007": Rule(
        "high",
        "LVM scans the paths of a multipath LUN whose map is a PV (duplicates)",
        rationale="LVM sees each PV twice and may use a single path, or refuse the volume group.",
        controls=STORAGE,
    ),
    "HANA-LAYOUT-008": Rule(
        "medium",
        "the LV's segments differ in stripe count or stripe size",
        rationale="A growth that added a narrower segment spreads the newest data over fewer LUNs, for good.",
        controls=STORAGE,
    ),
    "HANA-LAYOUT-009": Rule(
        "medium",
        "XFS is smaller than its device (the volume grew, the filesystem did not)",
        FS_GROWN,
        rationale="HANA sees no more room than before the growth and runs full while the space sits unused.",
        controls=STORAGE,
    ),
    "HANA-PERSIST-001": Rule(
        "high",
        "crypttab entry missing or different",
        CRYPTTAB,
        rationale="The volume does not open at boot as designed (or opens without its flags).",
        controls=("SC-28", "CM-6"),
    ),
    "HANA-PERSIST-002": Rule(
        "medium",
        "fstab entry or live mount options differ",
        MOUNT,
        rationale="The volume is not mounted at boot, or runs with other options than sized for.",
        controls=STORAGE,
    ),
    "HANA-PERSIST-003": Rule(
        "high",
        "keyslot needs more memory than the host gives each device opened at boot",
        rationale="systemd opens every crypttab line at once, each with the argon2 memory of its "
        "keyslot: together they can need more than the host has, and it does not come back after a reboot.",
        controls=("CP-10", "CM-6"),
    ),
    "HANA-KEY-001": Rule(
        "high",
        "key file readable by others than root",
        KEY_FILE,
        rationale="Whoever reads the key file can decrypt the volume.",
        controls=(*KEYS, "PCI-3.7.3"),
    ),
    "HANA-MOUNT-001": Rule(
        "high",
        "a HANA mountpoint is not mounted",
        rationale="HANA would write to the root file system beneath the mountpoint: unencrypted, unsized.",
        controls=("SC-28", *STORAGE),
    ),
    "HANA-KEY-002": Rule(
        "high",
        "a device of a Tang or TPM2 volume has no Clevis binding",
        CLEVIS_BINDING,
        rationale="The volume does not unlock at boot from the key servers or the TPM, only with the recovery key.",
        controls=(*KEYS, "PCI-3.7.2"),
    ),
    "HANA-KEY-003": Rule(
        "high",
        "a Clevis binding names other Tang servers, another threshold or other TPM2 PCRs than the pillar",
        rationale="A binding the pillar does not name is a way to the key outside the key store.",
        controls=(*KEYS, "PCI-3.7.7"),
    ),
    "HANA-KEY-004": Rule(
        "medium",
        "a Clevis binding was made with a Tang signing key the pillar no longer names",
        CLEVIS_BINDING,
        rationale="After the Tang server's keys were rotated, the binding still depends on the retired key.",
        controls=(*KEYS, "PCI-3.7.4"),
    ),
    "HANA-KEY-005": Rule(
        "high",
        "a keyslot opens the volume that the pillar does not account for",
        rationale="A passphrase or token nobody accounts for opens the volume without the key store: a back door.",
        controls=(*KEYS, "IA-5", "PCI-3.7.7"),
    ),
    "HANA-KEY-006": Rule(
        "medium",
        "no current, root-only LUKS header backup",
        HEADER_BACKUP,
        rationale="The header holds the only copies of the volume key: lose it, and every byte of the volume is "
        "lost, whatever keys are kept.",
        controls=("CP-9", "SC-12"),
    ),
    "HANA-KEY-007": Rule(
        "critical",
        "the LUKS header lost what its backup holds (another UUID, keyslots gone): restore it",
        rationale="The header was erased, overwritten or lost its key's keyslot: its backup may be the only way "
        "back to the data.",
        controls=("CP-9", "SC-12", "SI-7"),
    ),
    "HANA-KEY-008": Rule(
        "medium",
        "the pillar still names a previous key that opens no keyslot (rotation ended)",
        rationale="A retired key left in the pillar keeps key material in circulation after its cryptoperiod.",
        controls=(*KEYS, "PCI-3.7.5"),
    ),
    "HANA-KEY-009": Rule(
        "high",
        "the pillar keeps tpm2_reseal: every apply seals the TPM2 volumes to whatever booted",
        rationale="A changed boot chain would be sealed to by the next apply instead of being looked at.",
        controls=(*KEYS, "PCI-3.7.7"),
    ),
    "HANA-KEY-010": Rule(
        "medium",
        "the volume key is older than the cryptoperiod, or its date is not recorded",
        rationale="A volume key is never changed by rotating the keys that open it: past its cryptoperiod "
        "only a re-encryption replaces it.",
        controls=(*KEYS, "PCI-3.7.4"),
    ),
}


def rule_table():
    """{rule: {severity, remediation, title}}: what the master trusts, not what an event claims."""
    return {
        rule: {"severity": r.severity, "remediation": r.remediation, "title": r.title}
        for rule, r in RULES.items()
    }


def fix_order(finding):
    """Where a finding's fix goes in a remediation: header backups after every other fix (a
    backup is of the header the flag and Tang fixes leave, not of the one they rewrite)."""
    fix = RULES[finding["rule"]].fix
    return 1 if fix is HEADER_BACKUP else 0


def auto_rules():
    """The rules with a fix: what remediation may repair unless the pillar narrows it."""
    return [rule for rule, r in RULES.items() if r.fix]


def binding_verdict(binding, policy):
    """How a Clevis binding (core.luks.clevis_binding) stands to the pillar's ``policy`` (the
    plan's key.clevis: its Tang part and its TPM2 part):

    - ``matches``: exactly the pillar's TPM2 PCR bank and PCRs (or no TPM2), and exactly its Tang
      servers (by URL) and threshold, each made with the signing key the pillar names (its
      thumbprint is one of the key's, SHA-256 or SHA-1), or no Tang;
    - ``stale``: all that, but made with a Tang signing key the pillar no longer names - what
      rotating a Tang server's keys, then the pillar's thumbprints, leaves behind. Binding again
      checks the server's advertisement against the pillar's thumbprint;
    - ``foreign``: other servers, another threshold, other PCRs, another pin, or unreadable."""
    if "error" in binding or binding.get("tpm2") != policy["tpm2"]:
        return "foreign"
    tang = policy["tang"]
    if tang is None:
        return "foreign" if binding["servers"] else "matches"
    if binding["threshold"] != tang["threshold"]:
        return "foreign"
    if sorted(s["url"] for s in binding["servers"]) != sorted(s["url"] for s in tang["servers"]):
        return "foreign"
    unmatched = list(binding["servers"])
    for server in tang["servers"]:
        match = next(
            (b for b in unmatched if b["url"] == server["url"] and server["thumbprint"] in b["thumbprints"]),
            None,
        )
        if match is None:
            return "stale"
        unmatched.remove(match)
    return "matches"


def describe_policy(policy):
    """A Clevis policy (the plan's key.clevis) in words."""
    parts = []
    if policy["tpm2"]:
        ids = policy["tpm2"]["pcr_ids"]
        pcrs = f"PCRs {', '.join(map(str, ids))} ({policy['tpm2']['pcr_bank']})" if ids else "no PCR"
        parts.append(f"this host's TPM2 with {pcrs}")
    if policy["tang"]:
        urls = [s["url"] for s in policy["tang"]["servers"]]
        parts.append(f"{policy['tang']['threshold']} of the Tang servers {urls}")
    return " and ".join(parts)


def describe_binding(binding):
    """A Clevis binding (core.luks.clevis_binding) in the words of describe_policy."""
    if "error" in binding:
        return binding["error"]
    tang = {"threshold": binding["threshold"], "servers": binding["servers"]} if binding["servers"] else None
    return describe_policy({"tang": tang, "tpm2": binding.get("tpm2")}) or "nothing"


def header_backup_problem(fact, header, policy=None, key_opens=(), retired=()):
    """What is wrong with a header backup (hana_storage_host.header_backup) of the live LUKS
    ``header``: None, or {"code", "text", "rule"}.

    HANA-KEY-006 (auto: the fix makes a new backup, and replaces the old one only once the key is
    proven to open it): ``missing``, ``unreadable``, ``stale`` (the header gained keyslots, tokens
    or flags since, or keyslots changed that lost no access: see lost_keyslots), ``rekeyed`` (made
    before or during a re-encryption by the formula, which named the volume keys it replaces:
    restoring it would make every byte unreadable), ``exposed``. HANA-KEY-007 (manual: never replaced automatically, the backup
    may be the only way back): ``other_device`` (another UUID: a stray luksFormat),
    ``other_volume_key`` (the same UUID, a volume key the device has not, and no token of ours
    that retired it: a hand re-encryption, or a luksFormat that kept the UUID) or
    ``keyslots_lost`` (keyslots the backup holds are gone from the header: erased, killed or
    overwritten, or removed on purpose by a rotation killed before its new backup). A lost
    keyslot of a Clevis binding to the pillar's ``policy`` loses no access (the recovery key's
    keyslot holds the key): binding again restores it, so it is ``stale``."""
    if not fact["exists"]:
        return {"code": "missing", "text": "none", "rule": "HANA-KEY-006"}
    if "error" in fact:
        return {"code": "unreadable", "text": f"unreadable: {fact['error']}", "rule": "HANA-KEY-006"}
    if fact["uuid"] != header["uuid"]:
        return {
            "code": "other_device",
            "text": f"the header of another LUKS device (UUID {fact['uuid']}; the device's is {header['uuid']})",
            "rule": "HANA-KEY-007",
        }
    theirs, ours = set(fact.get("volume_keys") or []), set(header.get("volume_keys") or [])
    if theirs - ours and theirs - ours <= reencrypt.replaced_keys(header):
        # a backup made before or during a re-encryption by the formula, which named the keys it
        # replaces: restoring it would put a retired volume key over data re-encrypted since
        return {
            "code": "rekeyed",
            "text": "made before a re-encryption ended: a volume key in it no longer encrypts the device "
            "(restoring it would make the data unreadable)",
            "rule": "HANA-KEY-006",
        }
    if ours and theirs - ours:
        return {
            "code": "other_volume_key",
            "text": "it holds a volume key the device has not, and no re-encryption by the formula retired it: "
            "the header was re-encrypted by hand, or formatted anew with the same UUID. Restoring it "
            "makes every byte written with the new key unreadable: restore it only if the device was "
            "formatted over by mistake, else move it aside",
            "rule": "HANA-KEY-007",
        }
    lost = lost_keyslots(fact, header, policy, key_opens, retired)
    if lost:
        return {
            "code": "keyslots_lost",
            "text": f"keyslots {', '.join(map(str, lost))} of the backup are gone from the header"
            + ("" if header.get("keyslots") else " (it has no keyslot left: no key opens it)"),
            "rule": "HANA-KEY-007",
        }
    if fact["fingerprint"] != header.get("fingerprint"):
        return {
            "code": "stale",
            "text": "older than the header: keyslots, tokens or flags were added since",
            "rule": "HANA-KEY-006",
        }
    if fact["mode"] & 0o077 or fact["uid"] != 0:
        return {
            "code": "exposed",
            "text": f"mode {fact['mode']:04o}, owner uid {fact['uid']}",
            "rule": "HANA-KEY-006",
        }
    return None


def lost_keyslots(fact, header, policy=None, key_opens=(), retired=()):
    """The ids (in the backup) of the keyslots a header backup holds that the live ``header``
    lacks, but for those that lost no access:

    * the backup's Clevis bindings to the pillar's ``policy`` (binding again restores them);
    * a keyslot rewritten in place (the same id, a new salt: ``luksConvertKey``) that the volume's
      key opens (``key_opens``: the live header's keyslot ids it opens); one rewritten with
      another passphrase (``luksChangeKey`` of someone else's) did lose access;
    * a keyslot of the key a rotation retires (``retired``: the backup's keyslot ids the pillar's
      previous key opens), removed by a rotation killed before its new backup."""
    live = {k.get("fingerprint") for k in header.get("keyslots", [])}
    kept = pillar_clevis_keyslots({"tokens": fact.get("tokens", [])}, policy)
    kept |= set(rewritten_keyslots(fact, header)) & {str(k) for k in key_opens}
    kept |= {str(k) for k in retired}
    return [
        k["id"] for k in fact.get("keyslots", []) if k["fingerprint"] not in live and str(k["id"]) not in kept
    ]


def rewritten_keyslots(fact, header):
    """The ids (str) of the keyslots a header backup holds that the live ``header`` has under the
    same id but rewritten (another fingerprint): whether the volume's key opens them decides
    whether they were lost (lost_keyslots)."""
    live = {str(k.get("id")): k.get("fingerprint") for k in header.get("keyslots", [])}
    return [
        str(k["id"])
        for k in fact.get("keyslots", [])
        if str(k["id"]) in live and live[str(k["id"])] != k["fingerprint"]
    ]


def pillar_clevis_keyslots(header, policy):
    """Keyslots of the Clevis bindings to the pillar's ``policy`` (the plan's key.clevis, or
    None): their passphrase is random bytes made by Clevis, accounted for like the key's. A
    binding to anything else (``foreign``) is not."""
    if not policy:
        return set()
    return {
        str(slot)
        for token in header.get("tokens", [])
        if token["type"] == "clevis" and binding_verdict(token["clevis"], policy) != "foreign"
        for slot in token["keyslots"]
    }


def restore_hint(device, backup):
    """How a person restores a LUKS header from its backup (the device's data stays)."""
    return (
        f"close what sits on it, then cryptsetup luksHeaderRestore {device} --header-backup-file {backup}, "
        "and check that the volume's key opens it"
    )


def fix_for(plan, finding, volume_summary):
    """The state call that repairs ``finding``: {"state", "kwargs"}, or {"code"} when there is
    none - ``manual_rule`` (no fix in the table), ``not_mounted`` (the fix needs the volume
    mounted), ``no_fix`` (the finding names a device the plan does not manage)."""
    fix = RULES[finding["rule"]].fix
    if fix is None:
        return {"code": "manual_rule"}
    if fix.needs and not volume_summary.get(fix.needs):
        return {"code": f"not_{fix.needs}"}
    volume = plan["volumes"][finding["volume"]]
    scope = {"volume": volume, "luks": plan["luks"]}
    if fix.per == "crypt":
        named = [c for c in volume["crypt"] if finding["device"] == f"/dev/mapper/{c['name']}"]
        if not named:
            return {"code": "no_fix"}
        scope["crypt"] = named[0]
    kwargs = {}
    for arg, path in fix.args.items():
        value = scope
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None  # None: not in this plan
        kwargs[arg] = value
    return {"state": fix.state, "kwargs": kwargs}


# crypttab options the formula decides on besides the flags' (plan luks.flags); others an admin
# adds are left alone
MANAGED_CRYPTTAB_OPTIONS = {"luks", "noauto", "_netdev"}


def audit(plan, facts):
    ignored = set(plan.get("compliance", {}).get("ignore_rules", []))
    findings, volumes = [], {}
    for name in sorted(plan["volumes"]):
        found, summary = VolumeAudit(plan, plan["volumes"][name], facts).run()
        found = [f for f in found if f["rule"] not in ignored]
        summary.update(compliant=not found, rules=sorted({f["rule"] for f in found}))
        findings += found
        volumes[name] = summary
    return {"compliant": not findings, "findings": findings, "volumes": volumes}


class VolumeAudit:
    def __init__(self, plan, volume, facts):
        self.plan, self.volume, self.facts = plan, volume, facts
        self.luks = plan["luks"]
        self._managed_crypttab = MANAGED_CRYPTTAB_OPTIONS | {f["crypttab"] for f in self.luks["flags"]}
        self.devices = facts.get("devices", {})
        self.findings = []
        self.reencryption = {}  # crypt device path -> the header's re-encryption fact, while one runs
        # what the plan's keyslots are made with (core.kdf): the whole plan's, also in an audit
        # of some of its volumes
        self.boot = plan["luks"].get("boot") or {"share_kib": None}

    def add(self, rule, device, expected, actual, message):
        severity, remediation = RULES[rule].severity, RULES[rule].remediation
        self.findings.append(
            {
                "rule": rule,
                "severity": severity,
                "volume": self.volume["name"],
                "mountpoint": self.volume["mountpoint"],
                "device": device,
                "expected": expected,
                "actual": actual,
                "remediation": remediation,
                "message": message,
            }
        )

    # ---- the volume ------------------------------------------------------------------------
    def run(self):
        volume = self.volume
        mount = self._mount()
        top = self._top(mount)
        summary = {
            "mountpoint": volume["mountpoint"],
            "mounted": mount is not None,
            "device": self.devices[top]["path"] if top else None,
            "fstype": mount["fstype"] if mount else None,
            "layer": None,
            "crypt": [],
            "stack": [],
        }
        if mount is None:
            self.add(
                "HANA-MOUNT-001",
                volume["fs_device"],
                "mounted",
                "not mounted",
                f"{volume['mountpoint']} is not mounted: HANA would write to the root filesystem",
            )
        underway = self.facts.get("in_place", {}).get(volume["name"])
        if underway and top:
            self._in_place_rules(top, underway, summary)
        elif top:
            self._stack_rules(top, mount, summary)
        elif mount is not None:
            self.add(
                "HANA-ENC-001",
                mount["source"],
                "a dm-crypt device",
                f"{mount['fstype']} from {mount['source']}",
                f"{volume['mountpoint']} is mounted from {mount['source']} ({mount['fstype']}), "
                "which is not an encrypted block device",
            )
        self._closed_crypt_rules()
        self._crypttab_rules()
        self._fstab_rules(top, mount)
        self._key_rules()
        self._naming_rules()
        summary["reencryption"] = self.reencryption
        return self.findings, summary

    def _in_place_rules(self, top, underway, summary):
        """While the formula encrypts the volume in place, its stack is cryptsetup's: crypt and
        plaintext segments over hotzone and overlay devices, no LUKS header on most of them.
        What holds is that part of the volume is still plaintext (HANA-ENC-001, with how far the
        encryption is); once nothing runs it, a device of that stack left suspended is the frozen
        I/O of a killed cryptsetup (HANA-LAYOUT-004)."""
        info = stack.describe(self.devices, top)
        summary.update(layer="in_place", stack=info["devices"], in_place=underway)
        progress = underway.get("progress")
        name = self.volume["crypt_name"]
        if underway.get("mode") == "moves":  # below LVM: each PV moved onto a LUKS PV
            how = underway.get("text") or f"encrypting {name} PV by PV"
            if not underway.get("running"):
                how += ": not running, the next apply starts it again"
        elif underway.get("running"):
            how = inplace.describe(name, progress)
        else:
            stopped = f" (stopped at {progress['percent']} %)" if progress else ""
            how = f"the encryption of {name} in place is under way but not running{stopped}: the next apply goes on"
        self.add(
            "HANA-ENC-001",
            self.devices[top]["path"],
            "every block encrypted",
            f"{progress['percent']} % encrypted" if progress else "encryption in place under way",
            f"{self.volume['mountpoint']} is being encrypted in place: part of it is still plaintext ({how})",
        )
        if not underway.get("running"):
            self._health_rules(info)

    def _naming_rules(self):
        names = self.facts.get("device_names", {})
        for device in self.volume["devices"]:
            fact = names.get(device) or {}
            if fact.get("unstable") and fact.get("stable"):
                self.add(
                    "HANA-LAYOUT-006",
                    device,
                    fact["stable"][0],
                    device,
                    f"hana:storage:volumes:{self.volume['name']}:devices names {device}, a name the "
                    f"kernel may give another disk at the next boot; name it {fact['stable'][0]}",
                )

    def _mount(self):
        mounts = [m for m in self.facts.get("mounts", []) if m["mountpoint"] == self.volume["mountpoint"]]
        return mounts[-1] if mounts else None  # the last one is on top

    def _top(self, mount):
        """The device the volume's filesystem is on: the mounted one, else the expected one if present."""
        if mount:
            return next((n for n, d in self.devices.items() if d["dev"] == mount["dev"]), None)
        return next((n for n, d in self.devices.items() if d["dm_name"] == self.volume["fs_dm_name"]), None)

    # ---- what the stack under the filesystem is -------------------------------------------
    def _stack_rules(self, top, mount, summary):
        info = stack.describe(self.devices, top)
        summary.update(
            layer=info["layer"],
            crypt=[self.devices[c]["dm_name"] for c in info["crypts"]],
            stack=info["devices"],
        )
        top_path = self.devices[top]["path"]
        if not info["crypts"]:
            self.add(
                "HANA-ENC-001",
                top_path,
                "a dm-crypt layer",
                "no crypt target in " + " -> ".join(info["devices"]),
                f"{self.volume['mountpoint']} is not encrypted: {' -> '.join(info['devices'])} "
                "has no dm-crypt device",
            )
        elif info["unencrypted"]:
            self.add(
                "HANA-ENC-001",
                top_path,
                "every disk under a crypt target",
                "unencrypted path to " + ", ".join(info["unencrypted"]),
                f"data of {self.volume['mountpoint']} reaches {', '.join(info['unencrypted'])} "
                "without passing a dm-crypt device",
            )
        for crypt in info["crypts"]:
            self._crypt_rules(self.devices[crypt])
        self._health_rules(info)
        for name in info.get("direct_paths", []):
            path = self.devices[name]["path"]
            self.add(
                "HANA-LAYOUT-005",
                path,
                "the LUN's multipath map (/dev/mapper/...)",
                f"one path: {path}",
                f"{self.volume['mountpoint']} uses {path}, one path of a multipath LUN: when that path "
                "fails, I/O fails although the LUN is still reachable over the others",
            )
        self._lvm_path_rules(info)
        if (
            info["layer"] in ("above_lvm", "below_lvm", "mixed")
            and info["layer"] != self.volume["encryption"]
        ):
            self.add(
                "HANA-LAYOUT-002",
                top_path,
                self.volume["encryption"],
                info["layer"],
                f"{self.volume['mountpoint']} is encrypted {info['layer'].replace('_', ' ')}, "
                f"the pillar says {self.volume['encryption'].replace('_', ' ')}",
            )
        self._lv_rules(info, top_path)
        if mount and mount["fstype"] == "xfs":
            self._xfs_rules(top)

    def _lvm_path_rules(self, info):
        """Above LVM the PVs are the multipath maps: LVM must not reach the LUNs through their
        paths too, or it sees every PV twice (``facts["lvm_scans"]``: what ``pvs -a`` lists)."""
        if self.volume["encryption"] != "above_lvm" or "lvm_scans" not in self.facts:
            return
        scans = self.facts["lvm_scans"]
        for name in info["devices"]:
            device = self.devices[name]
            if device["kind"] != "multipath":
                continue
            seen = None if scans is None else sorted(set(device["slaves"]) & set(scans))
            if seen == []:
                continue
            self.add(
                "HANA-LAYOUT-007",
                device["path"],
                "LVM scans the map, not its paths",
                seen if seen is not None else "pvs -a failed: not known",
                f"{device['path']}: LVM scans the paths of this multipath LUN too "
                f"({', '.join(seen) if seen else 'pvs -a could not tell'}), so it sees every PV on it twice: "
                "hide the paths from LVM (lvm.conf global_filter, multipath_component_detection with "
                "the wwids file, or RHEL 9's devices file)",
            )

    def _health_rules(self, info):
        # a running re-encryption suspends its hotzone device while it works on it (about a
        # second: reencrypt.hotzone_mib); one nothing runs any more left it frozen. Only the
        # stack under this volume's own running crypt is cryptsetup's, never a crypt of the plan.
        running = {c for c, up in self.facts.get("reencrypting", {}).items() if up}
        plan_crypts = {c["name"] for v in self.plan.get("volumes", {}).values() for c in v.get("crypt", [])}
        working = set()
        for name in info["devices"]:
            crypt = self.devices[name].get("dm_name")
            if crypt in running:
                below = {self.devices[n].get("dm_name") for n in stack.stack(self.devices, name)}
                working |= (below & inplace.reencryption_stack(crypt)) - plan_crypts
        suspended = [
            self.devices[n]["path"]
            for n in info["devices"]
            if self.devices[n]["suspended"] and self.devices[n].get("dm_name") not in working
        ]
        missing = []
        for name in info["devices"]:
            for segment in self.devices[name]["table"]:
                refs = [segment] if "device" in segment else segment.get("devices", [])
                missing += [
                    r["device"] for r in refs if "device" in r and r.get("device_name") not in self.devices
                ]
        for name in info["lvs"]:
            for segment in self._lv_segments(name):
                missing += [d for d in segment["devices"] if d.startswith("[unknown]")]
        if suspended or missing:
            actual = [f"suspended: {p}" for p in suspended] + [f"missing: {d}" for d in missing]
            self.add(
                "HANA-LAYOUT-004",
                self.devices[info["top"]]["path"],
                "every device present and active",
                actual,
                f"{self.volume['mountpoint']}: " + "; ".join(actual) + " (I/O to the volume stalls or fails)",
            )

    def _crypt_rules(self, device):
        luks, path = self.luks, device["path"]
        segment = next(s for s in device["table"] if s["target"] == "crypt")
        backing = segment.get("device_name")
        header = self.facts.get("headers", {}).get(backing) if backing else None
        if device["crypt_type"] == "PLAIN" or header is None or "error" in header:
            reason = (
                "a plain dm-crypt mapping"
                if device["crypt_type"] in ("PLAIN", None)
                else f"LUKS header unreadable: {header['error'] if header else 'not read'}"
            )
            self.add(
                "HANA-ENC-005",
                path,
                "a LUKS2 header",
                reason,
                f"{path} has no usable LUKS header ({reason}): its key cannot be managed or rotated",
            )
            header = None
        elif header.get("degraded"):
            bad = {k: v for k, v in header.get("copies", {}).items() if v != "ok"}
            self.add(
                "HANA-ENC-007",
                path,
                "both LUKS2 header copies intact",
                bad,
                f"{path}: LUKS2 header degraded ({'; '.join(f'{k}: {v}' for k, v in bad.items())}); "
                "back it up (cryptsetup luksHeaderBackup) and repair it",
            )
        reencryption = (header or {}).get("reencryption")
        underway = _reencryption_text(reencryption) if reencryption else None
        note = f" ({underway})" if underway else ""
        if reencryption:
            self.reencryption[path] = reencryption
        if header and self.volume["key"].get("clevis"):
            self._clevis_rules(path, header)
            if self.plan.get("tpm2_reseal") and self.volume["key"]["clevis"]["tpm2"]:
                self.add(
                    "HANA-KEY-009",
                    path,
                    "tpm2_reseal given on the command line for one apply, not kept in the pillar",
                    True,
                    f"{path}: the pillar keeps hana:storage:tpm2_reseal, so every apply binds this TPM2 volume "
                    "again to whatever booted; remove it from the pillar and give it on the command line after "
                    "a planned change only",
                )
        if header and header["version"] != 2:
            self.add(
                "HANA-ENC-002",
                path,
                2,
                header["version"],
                f"{path} is LUKS{header['version']}: no persistent perf flags, weak PBKDF2 keyslots; "
                "convert with cryptsetup convert --type luks2",
            )
        if segment["cipher"] != luks["cipher"]:
            self.add(
                "HANA-ENC-003",
                path,
                luks["cipher"],
                segment["cipher"],
                f"{path} encrypts with {segment['cipher']}, the policy asks for {luks['cipher']}{note}",
            )
        if segment["key_bits"] < luks["key_size"]:
            self.add(
                "HANA-ENC-004",
                path,
                luks["key_size"],
                segment["key_bits"],
                f"{path} has a {segment['key_bits']}-bit key, below the policy's {luks['key_size']} bits{note}",
            )
        if header:
            self._kdf_rules(path, header, backing)
            self._keyslot_rules(path, header, backing)
            self._header_backup_rules(path, device["dm_name"], header)
            self._volume_key_age_rule(path, header, note)
        if segment["sector_size"] != luks["sector_size"]:
            self.add(
                "HANA-PERF-001",
                path,
                luks["sector_size"],
                segment["sector_size"],
                f"{path} uses {segment['sector_size']}-byte sectors, the policy asks for {luks['sector_size']} "
                + f"({underway or 're-encryption needed: cryptsetup reencrypt --sector-size'})",
            )
        self._flag_rules(path, segment, header)
        self._driver_rules(path, segment)

    def _volume_key_age_rule(self, path, header, note):
        """HANA-KEY-010: the volume key's date (reencrypt.KEY_DATE_TOKEN) against the policy's
        cryptoperiod, on the host's date (``facts["today"]``, ISO). LUKS1 has no tokens: its
        key's age is unknown, and only a conversion to LUKS2 and a re-encryption date it."""
        max_age = self.luks.get("volume_key_max_age_days")
        today = self.facts.get("today")
        if not max_age or not isinstance(today, str) or header.get("version") not in (1, 2):
            return
        try:
            age = reencrypt.key_age_days(header, datetime.date.fromisoformat(today))
        except ValueError:
            return  # the host's date unread: no age to judge
        if age is not None and age <= max_age:
            return
        said = "of unknown age (no date recorded)" if age is None else f"{age} days old"
        if header.get("version") == 1:
            said, note = (
                "of unknown age (LUKS1 records no date)",
                f"{note} after cryptsetup convert --type luks2",
            )
        self.add(
            "HANA-KEY-010",
            path,
            f"a volume key at most {max_age} days old",
            "unknown" if age is None else age,
            f"{path}: its volume key is {said}, the cryptoperiod {max_age} days: re-encrypt it "
            f"(a new volume key){note}",
        )

    def _driver_rules(self, path, segment):
        if segment["cipher"] != self.luks["cipher"]:
            return  # another cipher is HANA-ENC-003, whatever runs it
        drivers = self.facts.get("crypto_drivers", {})
        if "error" in drivers:
            driver = {"driver": f"not read: {drivers['error']}", "generic": True}
        else:
            driver = drivers.get(segment["cipher"])
        if driver and driver["generic"]:
            self.add(
                "HANA-PERF-005",
                path,
                "a hardware-accelerated driver",
                driver["driver"],
                f"{path}: the kernel runs {segment['cipher']} with {driver['driver']}, a generic software "
                "driver (no AES instructions in use: check the CPU flags and the accelerated module, "
                "aesni_intel on x86, vmx_crypto on POWER)",
            )

    def _kdf_rules(self, path, header, backing):
        clevis = self._pillar_clevis_keyslots(header)
        where = self.devices[backing]["path"] if backing in self.devices else "<its device>"
        fips = bool(self.luks.get("fips"))
        refused = dict(kdf.not_fips_usable(header["keyslots"])) if fips else {}
        minimum = self.plan.get("compliance", {}).get("min_pbkdf", {})
        if fips:  # every keyslot is PBKDF2 there (pillar.py refuses another minimum before an apply)
            minimum = {**minimum, "type": "pbkdf2"}
        weak = [  # a keyslot without a KDF holds no key (a re-encryption's reencrypt keyslot)
            f"keyslot {s['id']}: {_kdf_text(s['kdf'])}"
            for s in header["keyslots"]
            if s.get("kdf") is not None
            and str(s["id"]) not in clevis
            and s["id"] not in refused  # HANA-ENC-008's
            and kdf.weaker(s["kdf"], minimum)
        ]
        if weak:
            remake = (
                f"--pbkdf pbkdf2 --hash sha256 --pbkdf-force-iterations {minimum.get('iterations', 0)}"
                if fips
                else "--pbkdf argon2id"
            )
            self.add(
                "HANA-ENC-006",
                path,
                _kdf_text({"type": "argon2i", **minimum}),
                weak,
                f"{path}: {', '.join(weak)} weaker than policy; make it again with "
                f"cryptsetup luksConvertKey {where} --key-slot <n> {remake} --key-file <its key>",
            )
        if refused:
            convert = "; ".join(
                f"cryptsetup luksConvertKey {where} --key-slot {slot} --pbkdf pbkdf2 --hash sha256 "
                "--key-file <its key>"
                for slot in refused
            )
            self.add(
                "HANA-ENC-008",
                path,
                f"pbkdf2 with {', '.join(kdf.FIPS_HASHES)}",
                [f"keyslot {slot}: {kdf.name(made)}" for slot, made in refused.items()],
                f"{path}: {', '.join(f'keyslot {slot} ({kdf.name(made)})' for slot, made in refused.items())} "
                "cannot be opened in FIPS mode (this host's, or compliance:fips). Convert while FIPS mode "
                f"is off (in it, an argon2 keyslot cannot be opened to convert it): {convert}; state.apply "
                "makes the volume key's keyslot and a Clevis binding's again (states fips-N, clevis-N)",
            )
        share = self.boot["share_kib"]
        heavy = kdf.above_share(header["keyslots"], share)
        if heavy:
            convert = "; ".join(
                f"cryptsetup luksConvertKey {where} --key-slot {slot} --pbkdf-memory {share} --key-file <its key>"
                for slot, _ in heavy
            )
            self.add(
                "HANA-PERSIST-003",
                path,
                f"at most {share} KiB of argon2 memory per keyslot",
                [f"keyslot {slot}: {memory} KiB" for slot, memory in heavy],
                f"{path}: {', '.join(f'keyslot {slot} needs {memory} KiB' for slot, memory in heavy)}; "
                f"{self.boot['devices']} LUKS devices open together at boot and half of this host's "
                f"{self.boot['ram_kib'] // 1024} MiB of RAM gives each {share} KiB: the boot can run out "
                f"of memory. Convert: {convert}",
            )

    def _keyslot_rules(self, path, header, backing):
        """Every keyslot that opens the device is one the pillar accounts for: per volume key, one
        for the volume's key (the key file, the pillar key or a Tang volume's recovery key; a
        re-encryption has two volume keys, each with a copy), the keyslots the previous key of a
        rotation still opens (``facts["previous_keys"]``: tried on a copy of the header), and
        those of the Clevis bindings to the pillar's Tang servers. Another passphrase, or an
        enrolment by hand (a TPM2 or FIDO2 token, a Clevis binding on a volume that names no
        Tang), opens the volume without the key store: a back door. A Tang volume's binding to
        other servers is HANA-KEY-003's.

        Which passphrase keyslot is the key's the audit cannot tell without unlocking with the key
        (seconds of KDF per device, on every audit), so it names them all. The previous key is
        tried (once per header change) only while the pillar names one: once it opens nothing
        the rotation has ended, and a ``previous`` left in the pillar is HANA-KEY-008."""
        tokens = header.get("tokens", [])
        accounted = self._pillar_clevis_keyslots(header)
        if self.volume["key"].get("clevis"):
            accounted |= {str(slot) for t in tokens if t["type"] == "clevis" for slot in t["keyslots"]}
        previous = self._previous_key_rules(path, backing)
        accounted |= {str(slot) for slot in previous.get("keyslots", [])}
        token_of = {str(slot): t["type"] for t in tokens for slot in t["keyslots"]}
        by_volume_key = {}
        for slot in header["keyslots"]:
            if slot.get("volume_key") is not None and str(slot["id"]) not in accounted:
                by_volume_key.setdefault(slot["volume_key"], []).append(slot["id"])
        opening = [
            f"keyslot {kid}" + (f" (token {token_of[str(kid)]})" if str(kid) in token_of else "")
            for slots in by_volume_key.values()
            if len(slots) > 1
            for kid in slots
        ]
        if opening:
            untried = (
                f" (the previous key could not be tried: {previous['error']})"
                if previous.get("error")
                else ""
            )
            self.add(
                "HANA-KEY-005",
                path,
                "one keyslot for the volume's key, besides the pillar's Clevis bindings",
                opening,
                f"{path}: keyslots {', '.join(opening)} open it where the pillar accounts for one, its "
                "key's: find that one (cryptsetup open --test-passphrase --key-slot N with the key), then "
                f"check the others and cryptsetup luksKillSlot what nobody can account for{untried}",
            )

    def _previous_key_rules(self, path, backing):
        """What the rotation's previous key opens on ``backing`` ({"keyslots", "error"}; {} when the
        pillar names no previous key), and HANA-KEY-008 once it opens nothing."""
        previous = self.volume["key"].get("previous")
        if not previous:
            return {}
        fact = self.facts.get("previous_keys", {}).get(backing) or {"keyslots": [], "error": "not tried"}
        if not fact.get("keyslots") and not fact.get("error"):
            self.add(
                "HANA-KEY-008",
                path,
                "no previous key in the pillar once the rotation has ended",
                [],
                f"{path}: the pillar still names the previous key {previous['file']}, which opens no keyslot "
                "any more: the rotation has ended; drop key:previous from the pillar and the old key from "
                "the key store",
            )
        return fact

    def _closed_crypt_rules(self):
        """A crypt device of the plan that is not open (a volume shut down, a host before Salt
        opened it) still has its header on its device (``facts["closed_headers"]``, by crypt
        name): its backup is judged as for an open one. An erased header is damage whether or not
        the volume is open."""
        open_names = {d["dm_name"] for d in self.devices.values() if d["kind"] == "crypt"}
        for crypt in self.volume["crypt"]:
            header = self.facts.get("closed_headers", {}).get(crypt["name"])
            if crypt["name"] not in open_names and header and "error" not in header:
                self._header_backup_rules(f"/dev/mapper/{crypt['name']}", crypt["name"], header)

    def _header_backup_rules(self, path, crypt_name, header):
        """The LUKS header is the only copy of the volume key behind the keyslots: with
        ``header_backup`` in the pillar, each device has a root-only backup whose metadata is the
        live header's (a backup from before a keyslot change restores what the change removed)."""
        crypt = next((c for c in self.volume["crypt"] if c["name"] == crypt_name), {})
        backup = crypt.get("header_backup")
        if not backup:
            return
        fact = self.facts.get("header_backups", {}).get(backup, {"exists": False})
        key = self.volume["key"]
        slots = self.facts.get("backup_keyslots", {}).get(crypt_name) or {}
        problem = header_backup_problem(
            fact,
            header,
            key.get("clevis"),
            slots.get("live_opens", []),
            slots.get("retired", []),
        )
        if problem is None:
            return
        if problem["code"] == "other_volume_key":
            self.add(
                "HANA-KEY-007",
                path,
                f"the live header still holds what its backup {backup} holds",
                problem["text"],
                f"{path}: header backup {backup}: {problem['text']} (to restore: "
                f"{restore_hint(crypt['device'], backup)}). The backup is never replaced while it may be "
                "the only way back.",
            )
            return
        if problem["rule"] == "HANA-KEY-007":
            self.add(
                "HANA-KEY-007",
                path,
                f"the live header still holds what its backup {backup} holds",
                problem["text"],
                f"{path}: its LUKS header lost what the backup {backup} holds ({problem['text']}). If the "
                "volume's key no longer opens it, restore it now, before the device is closed: "
                f"{restore_hint(crypt['device'], backup)}. If the keyslots were removed on purpose, "
                "move the backup aside and apply again. The backup is never replaced while it may be "
                "the only way back.",
            )
            return
        self.add(
            "HANA-KEY-006",
            path,
            f"a current, root-only luksHeaderBackup at {backup}",
            problem["text"],
            f"{path}: header backup {backup}: {problem['text']}. Lose the header and every byte of the device is "
            "gone: back it up again (remediation does, cryptsetup luksHeaderBackup)",
        )

    def _pillar_clevis_keyslots(self, header):
        key = self.volume["key"]
        return pillar_clevis_keyslots(header, key.get("clevis"))

    def _clevis_rules(self, path, header):
        policy = self.volume["key"]["clevis"]
        bindings = [t["clevis"] for t in header.get("tokens", []) if t["type"] == "clevis"]
        if not bindings:
            self.add(
                "HANA-KEY-002",
                path,
                f"a Clevis binding to {describe_policy(policy)}",
                "none",
                f"{path} has no Clevis binding: it does not unlock at boot, only with the recovery key",
            )
            return
        foreign = [b for b in bindings if binding_verdict(b, policy) == "foreign"]
        if foreign:
            actual = [
                b
                if "error" in b
                else {
                    "threshold": b["threshold"],
                    "servers": [s["url"] for s in b["servers"]],
                    "tpm2": b.get("tpm2"),
                }
                for b in foreign
            ]
            self.add(
                "HANA-KEY-003",
                path,
                policy,
                actual,
                f"{path}: a Clevis binding to {'; '.join(describe_binding(b) for b in foreign)} is not "
                f"the pillar's ({describe_policy(policy)}): a binding the pillar does not name is a way "
                "in; check it, then clevis luks unbind it",
            )
        tang = policy["tang"]
        stale = [b for b in bindings if binding_verdict(b, policy) == "stale"]
        if stale:
            self.add(
                "HANA-KEY-004",
                path,
                [s["thumbprint"] for s in tang["servers"]],
                [s["thumbprints"][0] for b in stale for s in b["servers"]],
                f"{path}: bound to {[s['url'] for s in tang['servers']]} with a signing key the pillar no "
                "longer names (Tang's keys were rotated): bind it again to the current key",
            )

    def _flag_rules(self, path, segment, header):
        flags = self.luks["flags"]
        wanted = {f["dm"] for f in flags if f["wanted"]}
        active = set(segment["flags"])
        perf = {f["dm"] for f in flags if f["perf"]}
        want_perf, have_perf = wanted & perf, active & perf
        if want_perf != have_perf:
            self.add(
                "HANA-PERF-002",
                path,
                sorted(want_perf),
                sorted(have_perf),
                f"{path} runs with dm-crypt flags {sorted(have_perf) or 'none'}, the policy asks for "
                f"{sorted(want_perf) or 'none'}",
            )
        persistent = set(header["flags"]) if header and header["version"] == 2 else None
        if persistent is not None:
            want_stored = {f["header"] for f in flags if f["perf"] and f["wanted"]}
            have_stored = persistent & {f["header"] for f in flags if f["perf"]}
            if want_stored != have_stored:
                self.add(
                    "HANA-PERF-003",
                    path,
                    sorted(want_stored),
                    sorted(have_stored),
                    f"{path}: LUKS2 header stores flags {sorted(have_stored) or 'none'}, the policy asks for "
                    f"{sorted(want_stored) or 'none'} (lost at the next open)",
                )
        discards = next(f for f in flags if f["dm"] == "allow_discards")
        want_discards = discards["wanted"]
        have = {"active": discards["dm"] in active}
        if persistent is not None:
            have["persistent"] = discards["header"] in persistent
        if any(value != want_discards for value in have.values()):
            self.add(
                "HANA-PERF-004",
                path,
                want_discards,
                have,
                f"{path}: allow_discards is {have}, the policy says {want_discards}"
                + ("" if want_discards else " (discards reveal which blocks are free)"),
            )

    def _lv_segments(self, name):
        lvm = self.facts.get("lvm")
        if not isinstance(lvm, list):
            return []
        dm_path = f"/dev/mapper/{self.devices[name]['dm_name']}"
        return [s for s in lvm if s["dm_path"] == dm_path]

    def _lv_rules(self, info, top_path):
        want_stripes = self.volume["stripes"]
        want_size = self.volume["stripe_size_kib"] * 1024 if want_stripes > 1 else 0
        expected = {"stripes": want_stripes, "stripe_size": want_size}
        if not info["lvs"]:
            self.add(
                "HANA-LAYOUT-001",
                top_path,
                expected,
                "no LV",
                f"{self.volume['mountpoint']} is not on an LVM logical volume",
            )
            return
        for name in info["lvs"]:
            segments = self._lv_segments(name) or self._segments_from_table(name)
            geometries = [
                {
                    "stripes": segment["stripes"],
                    "stripe_size": segment["stripe_size"] if segment["stripes"] > 1 else 0,
                }
                for segment in segments
            ]
            if not geometries:
                continue
            path = self.devices[name]["path"]
            first = geometries[0]
            if first != expected:
                self.add(
                    "HANA-LAYOUT-001",
                    path,
                    expected,
                    first,
                    f"{path} stripes {first['stripes']} x {first['stripe_size'] // 1024} KiB, the "
                    f"pillar says {want_stripes} x {self.volume['stripe_size_kib']} KiB",
                )
            other = next((g for g in geometries[1:] if g != first), None)
            if other:
                self.add(
                    "HANA-LAYOUT-008",
                    path,
                    first,
                    other,
                    f"{path} has a segment of {other['stripes']} x {other['stripe_size'] // 1024} KiB "
                    f"after its {first['stripes']} x {first['stripe_size'] // 1024} KiB: data written there "
                    "is spread over fewer LUNs (a growth that was not striped)",
                )

    def _segments_from_table(self, name):
        segments = []
        for segment in self.devices[name]["table"]:
            if segment["target"] == "striped":
                segments.append({"stripes": segment["stripes"], "stripe_size": segment["chunk_bytes"]})
            elif segment["target"] == "linear":
                segments.append({"stripes": 1, "stripe_size": 0})
        return segments

    def _xfs_rules(self, top):
        superblock = self.facts.get("superblocks", {}).get(top)
        if superblock and "error" not in superblock:
            device_bytes = self.devices[top]["size_bytes"]
            if device_bytes - superblock["data_bytes"] >= xfs.GROWABLE_BYTES:
                self.add(
                    "HANA-LAYOUT-009",
                    self.devices[top]["path"],
                    device_bytes,
                    superblock["data_bytes"],
                    f"{self.volume['mountpoint']}: the XFS holds {superblock['data_bytes']} bytes of its "
                    f"device's {device_bytes} (grown without xfs_growfs)",
                )
        stripes = self.volume["stripes"]
        if stripes < 2 or (superblock or {}).get("unread") == "suspended":
            # not read through a suspended stack: HANA-LAYOUT-004's, or a running re-encryption's
            # hotzone; the geometry is not known, not wrong
            return
        unit = self.volume["stripe_size_kib"] * 1024
        expected = {"sunit": unit, "swidth": unit * stripes}
        if not superblock or "error" in superblock:
            actual = superblock["error"] if superblock else "superblock not read"
        else:
            actual = {"sunit": superblock["sunit_bytes"], "swidth": superblock["swidth_bytes"]}
            if actual == expected:
                return
        self.add(
            "HANA-LAYOUT-003",
            self.devices[top]["path"],
            expected,
            actual,
            f"{self.volume['mountpoint']}: XFS stripe unit/width {actual}, the stripes need {expected} "
            "(recreate the filesystem with mkfs.xfs -d su=..,sw=..)",
        )

    # ---- persistence and keys -----------------------------------------------------------------
    def _crypttab_rules(self):
        entries = self.facts.get("crypttab")
        for crypt in self.volume["crypt"]:
            path = f"/dev/mapper/{crypt['name']}"
            want_device, backing_dm_uuid = self._luks_uuid(crypt)
            source = stack.crypttab_source(want_device, backing_dm_uuid) if want_device else crypt["device"]
            expected = {
                "device": source,
                "keyfile": self.volume["key"]["crypttab"],
                "options": sorted(self.volume["crypttab_options"]),
            }
            if not isinstance(entries, list):
                actual = f"/etc/crypttab unreadable: {entries.get('error') if entries else 'not read'}"
            else:
                entry = next((e for e in entries if e["name"] == crypt["name"]), None)
                if entry is None:
                    actual = "no entry"
                else:
                    actual = {
                        "device": entry["device"],
                        "keyfile": entry["keyfile"],
                        "options": sorted(o for o in entry["options"] if o in self._managed_crypttab),
                    }
                    device_ok = entry["device"] in (expected["device"], crypt["device"]) or (
                        not want_device and entry["device"].startswith("UUID=")
                    )
                    if (
                        device_ok
                        and actual["keyfile"] == expected["keyfile"]
                        and actual["options"] == expected["options"]
                    ):
                        continue
            self.add(
                "HANA-PERSIST-001",
                path,
                expected,
                actual,
                f"/etc/crypttab entry for {crypt['name']}: {_difference(expected, actual)}",
            )

    def _luks_uuid(self, crypt):
        """(LUKS UUID, dm UUID of the device under it) of an open crypt device of the plan;
        (None, None) unless its header was read."""
        for device in self.devices.values():
            if device["dm_name"] == crypt["name"] and device["kind"] == "crypt":
                segment = next(s for s in device["table"] if s["target"] == "crypt")
                header = self.facts.get("headers", {}).get(segment.get("device_name"))
                if header and "error" not in header:
                    # a crypt opened on one path (HANA-LAYOUT-005) still belongs on the map at
                    # boot, as the state writes it from the pillar's device, the map
                    return header["uuid"], stack.dm_uuid_or_its_map(self.devices, segment.get("device_name"))
        return None, None

    def _fstab_rules(self, top, mount):
        volume, entries = self.volume, self.facts.get("fstab")
        superblock = self.facts.get("superblocks", {}).get(top) if top else None
        fs_uuid = superblock.get("uuid") if superblock and "error" not in superblock else None
        expected = {
            "spec": f"UUID={fs_uuid}" if fs_uuid else volume["fs_device"],
            "vfstype": volume["filesystem"],
            "options": sorted(volume["fstab_options"] or ["defaults"]),
        }
        problems, actual = [], None
        if not isinstance(entries, list):
            actual = f"/etc/fstab unreadable: {entries.get('error') if entries else 'not read'}"
            problems.append(actual)
        else:
            # the first entry of the mount point, as systemd's fstab-generator takes it
            wanted = tab.mount_key(volume["mountpoint"])
            entry = next((e for e in entries if tab.mount_key(e["file"]) == wanted), None)
            if entry is None:
                actual = "no entry"
                problems.append("no entry")
            else:
                actual = {
                    "spec": entry["spec"],
                    "vfstype": entry["vfstype"],
                    "options": sorted(entry["options"]),
                }
                if entry["spec"] not in (expected["spec"], volume["fs_device"]) and not (
                    not fs_uuid and entry["spec"].startswith("UUID=")
                ):
                    problems.append(f"device {entry['spec']} instead of {expected['spec']}")
                if entry["vfstype"] != expected["vfstype"]:
                    problems.append(f"type {entry['vfstype']} instead of {expected['vfstype']}")
                if actual["options"] != expected["options"]:
                    problems.append(
                        f"options {','.join(actual['options'])} instead of {','.join(expected['options'])}"
                    )
        if mount:
            live = set(mount["options"]) | set(mount["super_options"])
            missing = [o for o in volume["kernel_mount_options"] if o not in live]
            if missing:
                problems.append(f"mounted without {','.join(missing)}")
                actual = {"fstab": actual, "live_missing": missing}
        if problems:
            self.add(
                "HANA-PERSIST-002",
                volume["fs_device"],
                expected,
                actual,
                f"{volume['mountpoint']}: " + "; ".join(problems),
            )

    def _key_rules(self):
        key = self.volume["key"]
        fact = self.facts.get("key_files", {}).get(key["file"])
        if not fact or not fact.get("exists"):
            return
        if fact["mode"] & 0o077 or fact["uid"] != 0:
            self.add(
                "HANA-KEY-001",
                key["file"],
                "mode 0400 (or 0600), owner root",
                f"mode {fact['mode']:04o}, owner uid {fact['uid']}",
                f"key file {key['file']} is readable by others than root (mode {fact['mode']:04o}, "
                f"uid {fact['uid']})",
            )


def _reencryption_text(fact):
    """A LUKS2 re-encryption in progress in words: what a finding it explains says about it."""
    target = fact.get("target") or {}
    goal = ", ".join(
        part
        for part in (
            target.get("encryption") and f"to {target['encryption']}",
            target.get("sector_size") and f"{target['sector_size']}-byte sectors",
        )
        if part
    )
    how = ", ".join(str(fact[k]) for k in ("mode", "direction") if fact.get(k))
    return (
        "LUKS2 re-encryption in progress"
        + (f" {goal}" if goal else "")
        + (f" ({how})" if how else "")
        + ": cryptsetup reencrypt --resume-only continues it if it is not running"
    )


def _kdf_text(kdf):
    """A keyslot KDF (or the min_pbkdf policy) in words."""
    if kdf["type"] == "pbkdf2":
        return f"pbkdf2 ({kdf.get('iterations', 0)} iterations)"
    return f"{kdf['type']} ({kdf.get('memory', kdf.get('memory_kib', 0))} KiB, time {kdf.get('time', 0)})"


def _difference(expected, actual):
    if not isinstance(actual, dict):
        return str(actual)
    return "; ".join(
        f"{k} {actual.get(k)!r} instead of {v!r}" for k, v in expected.items() if actual.get(k) != v
    )
