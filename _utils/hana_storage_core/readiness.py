"""Will this host unlock its storage at the next boot? A verdict per /etc/crypttab line, from
facts read now by the execution module (``hana_storage.boot_readiness``). Pure code.

A line systemd opens at boot (every line without ``noauto``: those Salt opens) is ready when the
path systemd will take opens it now:

- its device is there (a ``UUID=`` that a device carries, a path that exists);
- a key file (the line's, or systemd's /etc/cryptsetup-keys.d/<name>.key for key ``none``): it
  exists and opens a keyslot of the device (tried on a copy of the header);
- no key file, with Clevis tokens: Clevis's password agent (``clevis-luks-askpass.path``)
  enabled, and when a token asks Tang (the network) ``remote-cryptsetup.target`` enabled and
  ``_netdev`` on the line; and Clevis unlocks a keyslot now, which asks the Tang servers and the
  TPM as the boot will. A TPM2 binding that fails is told by the PCRs that changed since it was
  bound (the formula's record of them);
- no key file and no Clevis token: systemd asks a person at the console, so it is not ready.

Lines of throw-away devices (swap, tmp, plain with a random key) need only their device. A line
whose way of opening this check cannot follow (a detached header, a key offset, a FIDO2 or
PKCS#11 token...) is ``unchecked``: not ready, since nobody knows. A line with ``nofail`` does
not stop the boot when it fails (``blocks_boot`` False), but its volume stays locked all the same.
Each problem is a code (``PROBLEMS``) with the cause and the fix in words.
"""

ASKPASS_UNIT = "clevis-luks-askpass.path"
NETWORK_UNIT = "remote-cryptsetup.target"  # what orders _netdev lines after the network
ASKPASS_UNITS = (ASKPASS_UNIT, NETWORK_UNIT)
# `systemctl is-enabled` answers that hold across a reboot; it exits 0 for enabled-runtime too
# (a link under /run, gone at the next boot)
ENABLED_FOR_GOOD = ("enabled", "static", "alias", "generated")
THROWAWAY_OPTIONS = {"swap", "tmp", "plain"}
RANDOM_KEYS = {"/dev/urandom", "/dev/random", "/dev/hw_random"}
# crypttab options that change how a line opens in ways this check does not follow
UNFOLLOWED_OPTIONS = (
    "header=", "keyfile-offset=", "keyfile-size=", "key-slot=", "keyfile-erase", "tpm2-device=",
    "fido2-device=", "pkcs11-uri=", "token-timeout=", "tcrypt", "bitlk",
)  # fmt: skip

PROBLEMS = {
    "device_missing": (
        "{device} is not there: systemd waits for it, then gives up",
        "bring the LUN back (its paths, multipath -ll), or correct the crypttab line",
    ),
    "key_file_missing": (
        "its key file {keyfile} does not exist",
        "have the key store put it back, then ask again",
    ),
    "key_does_not_open": (
        "its key file {keyfile} opens no keyslot of {device}",
        "put back the key the device was made with, or add this key to a keyslot (hana_storage.boot_readiness "
        "names the line; a key rotation that ended half way leaves this)",
    ),
    "header_unreadable": (
        "the LUKS header of {device} cannot be read: {error}",
        "hana_storage.audit names a damaged header (HANA-ENC-007); restore it from its backup",
    ),
    "unchecked": (
        "this check cannot follow how the line opens ({why})",
        "open a copy of its header by hand (cryptsetup open --test-passphrase) before the reboot",
    ),
    "key_untested": (
        "its key file {keyfile} could not be tried: {error}",
        "read the error; the audit (hana_storage.audit) names a damaged header",
    ),
    "no_unattended_unlock": (
        "no key file and no Clevis binding: systemd asks for a passphrase at the console",
        "bind the device to Tang (key source tang) or give it a key file",
    ),
    "askpass_disabled": (
        "{unit} is {state}: nothing answers systemd-cryptsetup's passphrase request at boot",
        "systemctl enable {unit} (state.apply hana.storage enables it)",
    ),
    "no_netdev": (
        "the line has no _netdev: systemd opens it before the network is up, when Tang cannot be reached",
        "add _netdev to its options (state.apply hana.storage writes it)",
    ),
    "not_in_crypttab": (
        "the pillar's {name} has no /etc/crypttab line: the boot does not open it",
        "state.apply hana.storage writes it (hana_storage.audit names it: HANA-PERSIST-001)",
    ),
    "noauto": (
        "the pillar's {name} opens at boot (its key: {source}), but its line has noauto: the boot skips it",
        "state.apply hana.storage writes the line without noauto (hana_storage.audit names it: HANA-PERSIST-001)",
    ),
    "pcr_changed": (
        "the TPM2 binding of keyslot {keyslot} is sealed to PCRs that changed since it was bound: {pcrs}",
        "if the change was planned (firmware, Secure Boot keys, boot loader): state.apply hana.storage "
        'pillar=\'{{"hana": {{"storage": {{"tpm2_reseal": true}}}}}}\' binds again to the PCRs as they are now, '
        "with the recovery key, and removes the old binding; if not, find out what changed the boot chain first",
    ),
    "tpm_unreadable": (
        "the TPM's PCRs cannot be read: {error}",
        "check the TPM (ls /dev/tpmrm0; tpm2_pcrread); a vTPM that was removed is a new TPM: bind again with "
        "the recovery key (state.apply hana.storage with pillar hana:storage:tpm2_reseal true)",
    ),
    "clevis_fails": (
        "Clevis unlocks no keyslot now: {error}",
        "check each Tang server (curl <url>/adv) and the binding (clevis luks list -d {device}). A server "
        "whose old keys were deleted after a rotation: put its new thumbprint (tang-show-keys) in the pillar "
        "and apply, which binds again with the recovery key and removes the old binding (clevis luks regen "
        "cannot: it unlocks with the old binding first); a changed PCR: a TPM2 rebinding",
    ),
}


MAX_TEXT = 1000  # characters of a cause or a fix: an error quoted in one is cut there


def problem(code, **facts):
    cause, fix = PROBLEMS[code]
    return {"code": code, "cause": cause.format(**facts)[:MAX_TEXT], "fix": fix.format(**facts)[:MAX_TEXT]}


def at_boot(line):
    return "noauto" not in line["options"]


def throwaway(line):
    return bool(THROWAWAY_OPTIONS & set(line["options"])) or line["keyfile"] in RANDOM_KEYS


def has_key_file(line):
    return line["keyfile"] not in ("none", "-", "")


def unfollowed(line):
    """Why this check cannot follow how ``line`` opens, or None."""
    options = [o for o in line["options"] for prefix in UNFOLLOWED_OPTIONS if o.startswith(prefix)]
    if options:
        return ", ".join(options)
    if has_key_file(line) and ":" in line["keyfile"]:
        return f"a key file on another device ({line['keyfile']})"
    return None


def judged_by_key(line):
    """Does ``line`` need its key (or Clevis) read to be judged? (Else its device alone.)"""
    return at_boot(line) and not throwaway(line) and unfollowed(line) is None


def line_verdict(line, facts):
    """{"name", "device", "at_boot", "blocks_boot", "ready", "problems"} of one crypttab ``line``
    (core.tab), from ``facts``: {"source": the device's path or None, "key": {"path", "exists",
    "opens", "error"} (a key file's, the line's or systemd's key directory's), "clevis":
    {"tokens", "network", "unlocks", "error"}, "units": {unit: is-enabled answer}}."""
    verdict = {
        "name": line["name"],
        "device": line["device"],
        "at_boot": at_boot(line),
        "blocks_boot": at_boot(line) and "nofail" not in line["options"],
        "problems": [],
    }
    if not verdict["at_boot"]:
        verdict["ready"] = True  # Salt opens it, with the key it writes: not the boot's business
        return verdict
    found = verdict["problems"]
    key, clevis = facts.get("key"), facts.get("clevis") or {}
    if not facts.get("source"):
        found.append(problem("device_missing", device=line["device"]))
    elif throwaway(line):
        pass
    elif why := unfollowed(line):
        found.append(problem("unchecked", why=why))
    elif key is not None:
        if not key.get("exists"):
            found.append(problem("key_file_missing", keyfile=key.get("path") or line["keyfile"]))
        elif key.get("opens") is False:
            found.append(problem("key_does_not_open", keyfile=key["path"], device=line["device"]))
        elif key.get("opens") is None:
            found.append(problem("key_untested", keyfile=key["path"], error=key.get("error") or "no answer"))
    elif has_key_file(line):
        found.append(problem("key_untested", keyfile=line["keyfile"], error="not tried"))
    elif not clevis.get("tokens"):
        if clevis.get("error"):
            found.append(problem("header_unreadable", device=line["device"], error=clevis["error"]))
        else:
            found.append(problem("no_unattended_unlock"))
    else:
        units = facts.get("units") or {}
        for unit in ASKPASS_UNITS if clevis.get("network") else (ASKPASS_UNIT,):
            state = units.get(unit) or "unknown"
            if state not in ENABLED_FOR_GOOD:
                found.append(problem("askpass_disabled", unit=unit, state=state))
        if clevis.get("network") and "_netdev" not in line["options"]:
            found.append(problem("no_netdev"))
        if not clevis.get("unlocks"):
            found += _tpm_problems(clevis.get("pcr_drift") or {})
            found.append(
                problem(
                    "clevis_fails",
                    error=clevis.get("error") or "no keyslot opened",
                    device=line["device"],
                )
            )
    verdict["ready"] = not found
    return verdict


def _tpm_problems(drift):
    """Why a TPM2 binding fails, from the PCR drift (hana_storage_host.pcr_drift)."""
    if "error" in drift:
        return [problem("tpm_unreadable", error=drift["error"])]
    return [
        problem("pcr_changed", keyslot=slot, pcrs=", ".join(f"PCR {i}" for i in changed))
        for slot, changed in sorted(drift.items())
        if changed
    ]


def verdict(lines, facts, plan=None):
    """{"ready", "lines"}: ``lines`` (core.tab.parse_crypttab) judged with ``facts`` [one per line],
    held to ``plan`` (the formula's, when the host has one: ``planned``)."""
    judged = [line_verdict(line, fact) for line, fact in zip(lines, facts, strict=True)]
    if plan:
        judged = planned(plan, lines, judged)
    return {"ready": all(j["ready"] for j in judged), "lines": judged}


def planned(plan, lines, judged):
    """``judged`` (the verdicts of ``lines``) held to ``plan``: each crypt device the boot should
    open (a key file or Tang volume; a pillar key's Salt opens) needs a line the boot opens. One
    with ``noauto`` is skipped by the boot; one with no line at all, too (a verdict of its own)."""
    by_name = {line["name"]: (line, verdict) for line, verdict in zip(lines, judged, strict=True)}
    missing = []
    for volume in plan["volumes"].values():
        source = volume["key"]["source"]
        if source == "pillar":
            continue
        for crypt in volume["crypt"]:
            line, verdict = by_name.get(crypt["name"], (None, None))
            if line is None:
                missing.append(
                    {
                        "name": crypt["name"],
                        "device": crypt["device"],
                        "at_boot": True,
                        "blocks_boot": False,
                        "ready": False,
                        "problems": [problem("not_in_crypttab", name=crypt["name"])],
                    }
                )
            elif not at_boot(line):
                verdict["problems"].append(problem("noauto", name=crypt["name"], source=source))
                verdict["ready"] = False
    return judged + missing


MAX_SUMMARY_PROBLEMS = 64  # "<line>: <code>" entries a summary names (a host has a handful of lines)


def summary(result):
    """What a fleet view shows of a host's verdict (``verdict``'s, or {"ready": None, "error"}):
    {"ready", "not_ready": ["<crypttab line>: <problem code>", ...]} and "error" when it has one."""
    not_ready = [
        f"{line['name']}: {found['code']}"
        for line in result.get("lines") or []
        if not line["ready"]
        for found in line["problems"]
    ]
    short = {"ready": result["ready"], "not_ready": not_ready[:MAX_SUMMARY_PROBLEMS]}
    if result.get("error"):
        short["error"] = result["error"]
    return short
