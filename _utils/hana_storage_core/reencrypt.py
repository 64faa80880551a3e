"""Re-encryption online of a LUKS2 volume the formula manages: to the policy's encryption sector
size (a volume made with 512-byte sectors) and to a new volume key once the one it has is older
than the policy's cryptoperiod (``luks:volume_key_max_age_days``; PCI DSS 4.0 3.6.1, 3.7.4).
Pure code: the host module reads the facts, the state runs the steps.

The route: ``cryptsetup reencrypt --init-only`` on the open device (the header gains a
re-encryption keyslot and a keyslot for the new volume key; nothing is unmounted), then the
online ``--resume-only`` in a systemd unit of its own, as the encryption in place runs
(inplace.reencrypt_unit). Resilience ``checksum``: each hotzone is written in place, and the
header keeps a checksum of each of its blocks, so that after a kill or a power cut the open
recovers the hotzone from whichever of the old and new ciphertext matches. (``journal`` writes
each hotzone twice; ``datashift`` needs room the device does not have.) cryptsetup holds all I/O
to a hotzone while it re-encrypts it (its hotzone device stays suspended), and left to itself
makes a checksum hotzone as large as the keyslots area's checksums cover: half of a 1 GiB
volume, I/O to it held for minutes under a cap. The unit bounds it (hotzone_mib).

The volume key's date lives in the header, in LUKS2 tokens of the formula's own
(``KEY_DATE_TOKEN``): {"created": day, "volume": LUKS UUID, "replaces": [fingerprints]} says "a
volume key of this volume made on that day, none of the keys the header held before" (their
fingerprints: luks.key_fingerprint). A token names its volume so that one copied from another
header (``cryptsetup token export``/``import``, a header template) dates nothing there; a
volume whose UUID was changed since has keys of unknown age. No secret binds a token to its
key: whoever may write the header can forge a date, as they can destroy the keyslots.
luksFormat writes one that replaces nothing. A re-encryption writes its own before its init,
replacing the key in use: cryptsetup refuses a token import on a header marked for
re-encryption, from the init to the end. So a token names the keys it does not date, never
the one it does (not made yet), and a key's date is the newest token that does not name it:

* a key made by luksFormat and re-encrypted since is dated by the re-encryption's token (the
  format's is older);
* during a re-encryption the old key keeps its date and the new one gets the token's: the
  volume's age is the older key's, which still encrypts what is not re-encrypted yet;
* an init that never happened leaves a token that names the key in use: it dates nothing;
* a key made by hand later is dated by the newest token of ours: older than it is, so the
  cryptoperiod runs out early, never late.

A header with no token of ours that dates each key in use has a volume key of unknown age.

cryptsetup refuses an encryption sector larger than the filesystem's (an XFS made with
512-byte sectors): such a volume keeps its sector size until its filesystem is made anew, and
the state says so instead of starting.
"""

import datetime
import json

KEY_DATE_TOKEN = "hana-storage-volume-key"


HOTZONE_MAX_MIB = 64  # at most a quarter of a second of held I/O at 500 MB/s


def hotzone_mib(max_mib_s=None):
    """The largest hotzone the unit re-encrypts at once, in MiB: ``HOTZONE_MAX_MIB``, and under a
    cap of ``max_mib_s`` (read and written at that rate each) half of it, so that I/O to a
    hotzone is held about a second at most. A smaller hotzone costs a header update more often
    (cryptsetup commits where it is after each)."""
    if not max_mib_s:
        return HOTZONE_MAX_MIB
    return max(1, min(HOTZONE_MAX_MIB, int(max_mib_s) // 2))


class ReencryptError(ValueError):
    """A fact about a volume's re-encryption that cannot be what the header or the host says."""


def key_date_token(day, volume, replaces=()):
    """The KEY_DATE_TOKEN (JSON text): a volume key of the LUKS volume whose UUID is ``volume``,
    made on ``day`` (a datetime.date), none of the keys with the fingerprints ``replaces`` (those
    the header holds before it is made)."""
    return json.dumps(
        {
            "type": KEY_DATE_TOKEN,
            "keyslots": [],
            "created": day.isoformat(),
            "volume": volume,
            "replaces": sorted(replaces),
        },
        sort_keys=True,
    )


MAX_REPLACED = 32  # a header has at most 32 keyslots, so at most as many keys to name


def token_date(token):
    """{"created": ISO date, "volume": LUKS UUID, "replaces": [fingerprints]} that a
    KEY_DATE_TOKEN (its parsed JSON) records, or {"error"}: a token of ours that does not say a
    date and a volume says nothing about a key's age. No "replaces" (or an empty one) replaces
    nothing."""
    created = token.get("created")
    if not isinstance(created, str) or len(created) != 10 or not created.isascii():
        return {"error": "a volume key date token without a date (YYYY-MM-DD)"}
    try:
        day = datetime.date.fromisoformat(created).isoformat()
    except ValueError:
        return {"error": f"a volume key date token with {created!r}, not a date"}
    volume = token.get("volume")
    if not isinstance(volume, str) or not 0 < len(volume) <= 40 or not volume.isascii():
        return {"error": "a volume key date token without the LUKS UUID of its volume"}
    replaces = token.get("replaces", [])
    if (
        not isinstance(replaces, list)
        or len(replaces) > MAX_REPLACED
        or not all(isinstance(r, str) and 0 < len(r) <= 64 and r.isascii() and r.isalnum() for r in replaces)
    ):
        return {"error": "a volume key date token whose 'replaces' is not a list of key fingerprints"}
    return {"created": day, "volume": volume, "replaces": sorted(replaces)}


def _dating_tokens(header):
    """(token id, date, replaced fingerprints) of each KEY_DATE_TOKEN with a valid date that
    names this header's volume."""
    return [
        (t["id"], datetime.date.fromisoformat(t["key_date"]["created"]), t["key_date"]["replaces"])
        for t in header.get("tokens", [])
        if t["type"] == KEY_DATE_TOKEN
        and isinstance(t.get("key_date"), dict)
        and "created" in t["key_date"]
        and t["key_date"]["volume"] == header.get("uuid")
    ]


def replaced_keys(header):
    """The fingerprints of the volume keys this volume's tokens of ours say were replaced: keys
    a re-encryption by the formula retired (it names them before its init)."""
    return {key for _, _, replaces in _dating_tokens(header) for key in replaces}


def key_dates(header, today=None):
    """{fingerprint: date or None} of each volume key in use (two during a re-encryption): the
    newest token that does not name it, None when every token names it (or there is none). A
    token dated after ``today`` dates nothing: a clock that ran ahead, or a forged token, must
    not make an old key young."""
    tokens = [t for t in _dating_tokens(header) if today is None or t[1] <= today]
    return {
        key: max((day for _, day, replaces in tokens if key not in replaces), default=None)
        for key in header.get("volume_keys", [])
    }


def volume_key_date(header, today=None):
    """The date of the oldest volume key in use (a datetime.date), or None when one of them is
    not dated (tokens after ``today`` date nothing), or the header names none."""
    dates = list(key_dates(header, today).values())
    return None if not dates or None in dates else min(dates)


def tokens_to_replace(header, today=None):
    """Before a re-encryption's own token is imported (the header has exactly one key in use):
    the ids of the tokens of ours it makes useless, to remove once it is in. One token that gives
    the key in use its date stays (the key keeps it until the re-encryption ends); every other
    one dates that key older than it is, or nothing, or any later key older than the new token
    does. So the tokens stay at most two, whatever the number of re-encryptions. A token dated
    after ``today`` dates nothing (key_dates), so it is never the one kept."""
    keys = header.get("volume_keys", [])
    if len(keys) != 1:
        return []  # a re-encryption under way (or no key): not the moment to import one
    key = keys[0]
    date = key_dates(header, today).get(key)
    kept = next(
        (tid for tid, day, replaces in _dating_tokens(header) if key not in replaces and day == date),
        None,
    )
    return [t["id"] for t in header.get("tokens", []) if t["type"] == KEY_DATE_TOKEN and t["id"] != kept]


def key_age_days(header, today):
    """Days since the volume key's date, or None when it is not recorded (a token dated after
    ``today`` records nothing: the age is unknown, which the cryptoperiod treats as too old)."""
    created = volume_key_date(header, today)
    return None if created is None else (today - created).days


def wants(header, policy_sector, fs_sector, max_age_days, today, below_lvm=False):
    """What a re-encryption of the volume would give it, from its parsed LUKS2 ``header``:

    {"sector": (from, to) or None, "new_key": why or None, "refused": why or None}.
    ``sector`` when the header's sector size is not ``policy_sector``; ``new_key`` when a
    cryptoperiod (``max_age_days``) is set and the volume key is older or of unknown age;
    ``refused`` when the sector size cannot change (the filesystem's ``fs_sector`` is smaller,
    or the device is a PV ``below_lvm``: then only a new key is wanted, if any) or the header is
    not LUKS2. Below LVM a new key leaves the PV as it is, but a sector size would change under
    the mounted LV, its VG meanwhile over PVs of mixed sector sizes (which vgextend refuses and
    the VM tier does not prove).
    """
    result = {"sector": None, "new_key": None, "refused": None}
    if header.get("version") != 2:
        result["refused"] = f"LUKS{header.get('version')}: re-encryption online needs LUKS2"
        return result
    current = header.get("sector_size")
    if current and current != policy_sector:
        if below_lvm:
            result["refused"] = (
                f"below LVM its {current}-byte sectors would change to {policy_sector} under the mounted LV, "
                "which the formula does not do: re-encrypt each PV by hand with the LV unmounted, to "
                "a sector size no larger than the XFS's (xfs_info: sectsz; a larger one needs the "
                f"filesystem made anew, mkfs.xfs -s size={policy_sector}, from a backup)"
            )
        elif fs_sector and fs_sector < policy_sector:
            result["refused"] = (
                f"its filesystem has {fs_sector}-byte sectors: an encryption sector of {policy_sector} bytes "
                "would leave it unmountable (cryptsetup refuses it); make the filesystem anew with "
                f"mkfs.xfs -s size={policy_sector} from a backup to change it"
            )
        else:
            result["sector"] = (current, policy_sector)
    if max_age_days:
        age = key_age_days(header, today)
        if age is None:
            result["new_key"] = "its volume key's date is not recorded"
        elif age > max_age_days:
            result["new_key"] = f"its volume key is {age} days old, the cryptoperiod {max_age_days} days"
    return result


def reencrypt_init(device, key_file, keyslot, sector, pbkdf_args):
    """``cryptsetup reencrypt --init-only`` of the open LUKS2 ``device``, to ``sector``-byte
    sectors and a new volume key (cryptsetup always makes one), checksum resilience. The key is
    named by its file only, with the ``keyslot`` it opens: cryptsetup takes a key file for a new
    volume key only with --key-slot (or one keyslot in all). That keyslot alone gets a copy of
    the new volume key, and its tokens follow it; every other keyslot (a Clevis binding, a
    previous key, a backup keyslot) opens the old volume key only, and is gone when the
    re-encryption ends (libcryptsetup src/utils_reencrypt.c, reencrypt_luks2_init).
    ``pbkdf_args`` (commands.pbkdf_args of the policy) make the new keyslot."""
    return [
        "cryptsetup",
        "reencrypt",
        "--batch-mode",
        "--init-only",
        "--resilience",
        "checksum",
        "--sector-size",
        str(sector),
        "--key-slot",
        str(keyslot),
        *pbkdf_args,
        "--key-file",
        key_file,
        device,
    ]


def _dropped(header, keyslot):
    """What a re-encryption with the key's ``keyslot`` alone would drop, said as a blocker, or
    None: every other keyslot (an escrow passphrase, a binding) and every token but our date's
    (Clevis, systemd-tpm2, FIDO2: they name keyslots that end up opening nothing)."""
    others = [
        f"keyslot {k['id']}"
        for k in header.get("keyslots", [])
        if k.get("type") != "reencrypt" and str(k.get("id")) != str(keyslot)
    ] + [f"a {t['type']} token" for t in header.get("tokens", []) if t["type"] != KEY_DATE_TOKEN]
    if not others:
        return None
    return (
        f"only the key's keyslot gets the new volume key, and the re-encryption would drop {', '.join(others)}: "
        "remove them yourself if that is meant"
    )


def stage(facts, policy_sector, max_age_days, today, below_lvm=False):
    """(stage, why, target sector or None) of a LUKS2 crypt device, from its facts:

    {"header": the parsed header (None: not LUKS), "mapped": its crypt mapping exists,
    "running": a re-encryption of it runs (the unit, or cryptsetup by hand), "leftovers" and
    "suspended" (inplace.leftovers: a killed run's hotzone and overlay devices), "fs_sector":
    the sector size of the XFS above it (None: not known), "keyslot": the keyslot the volume's
    key opens (None: none)}. Every other keyslot and token of the header blocks it (_dropped).
    ``below_lvm``: the device is a PV, whose sector size stays (wants).

    Stages: ``absent`` (no LUKS2 header: the LUKS states make it), ``current`` (nothing to do),
    ``refused`` (wanted, but not possible: ``why`` says so), ``wanted`` (start: init, date
    token, unit), and, with a re-encryption of mode ``reencrypt`` under way, ``running``,
    ``paused``, ``closed``, ``crashed`` and ``frozen`` as in inplace.stage; another mode is
    ``foreign`` (an encryption in place is the in-place route's; a decryption someone's).
    """
    header = facts.get("header")
    if not header:
        return "absent", "has no LUKS header yet", None
    underway = header.get("reencryption")
    if underway:
        if underway.get("mode") != "reencrypt":
            return (
                "foreign",
                f"is under a re-encryption of mode {underway.get('mode')}, not a re-encryption",
                None,
            )
        target = (underway.get("target") or {}).get("sector_size")
        if facts.get("running"):
            return "running", "is being re-encrypted", target
        if not facts.get("mapped"):
            return "closed", "is being re-encrypted, but not open and nothing runs it", target
        if facts.get("leftovers") and facts.get("suspended"):
            return (
                "frozen",
                (
                    f"was being re-encrypted when cryptsetup was killed, and {', '.join(facts['suspended'])} "
                    "of its stack stayed suspended: I/O to it hangs"
                ),
                target,
            )
        if facts.get("leftovers"):
            return (
                "crashed",
                (
                    f"was being re-encrypted when cryptsetup was killed: {', '.join(facts['leftovers'])} still "
                    "in its stack"
                ),
                target,
            )
        return "paused", "is being re-encrypted, open, and nothing runs it", target
    want = wants(header, policy_sector, facts.get("fs_sector"), max_age_days, today, below_lvm)
    reasons = [
        f"its {want['sector'][0]}-byte sectors want {want['sector'][1]}" if want["sector"] else None,
        want["new_key"],
    ]
    reasons = [r for r in reasons if r]
    if not reasons:
        if want["refused"]:
            return "refused", want["refused"], None
        return "current", "needs no re-encryption", None
    why = "; ".join(reasons) + (f" (its sector size stays: {want['refused']})" if want["refused"] else "")
    for blocker in (
        "it is not open: re-encryption online needs its mapping" if not facts.get("mapped") else None,
        (
            "the volume's key opens none of its keyslots"
            + (f" ({facts['keyslot_error']})" if facts.get("keyslot_error") else "")
            if facts.get("keyslot") is None
            else None
        ),
        _dropped(header, facts.get("keyslot")),
        "the sector size of the filesystem above it is not known"
        if want["sector"] and not facts.get("fs_sector")
        else None,
    ):
        if blocker:
            return "refused", f"{why}, but {blocker}", None
    return "wanted", why, want["sector"][1] if want["sector"] else header.get("sector_size")
