"""What a keyslot's key derivation costs, and what the host can give it at boot. Pure code.

At boot systemd opens every crypttab line at once (one systemd-cryptsetup unit each, in
parallel), and each open allocates the argon2 memory its keyslot was made with. cryptsetup caps
one keyslot at half the host's RAM when it makes it, one device at a time; sixteen LUKS devices
below LVM made that way ask for eight times the RAM together, and the boot stalls or the OOM
killer ends it. So a keyslot the formula makes gets at most an equal share of half the RAM among
the LUKS devices opened at boot, and the audit names keyslots above their share (HANA-PERSIST-003).
"""

# What cryptsetup gives an argon2 keyslot when not told (its LUKS2 default memory cost), and the
# least it accepts (0 on its command line means "not told").
CRYPTSETUP_ARGON2_MEMORY_KIB = 1 << 20
ARGON2_MIN_KIB = 32
MEMORY_HARD = ("argon2i", "argon2id")
STRENGTH = {"pbkdf2": 0, "argon2i": 1, "argon2id": 2}
NOT_AT_BOOT = {"noauto"}  # crypttab options that keep a line out of the boot
NO_KDF = {"plain", "swap", "tmp"}  # crypttab lines that open without a keyslot
PRIORITY_IGNORE = 0  # a keyslot cryptsetup only tries when asked for it by number


def boot_share_kib(mem_total_kib, devices):
    """The argon2 memory one keyslot may have when ``devices`` LUKS devices open together at
    boot on a host with ``mem_total_kib`` of RAM: half the RAM, shared equally. None when the
    RAM is not known."""
    if not mem_total_kib:
        return None
    return mem_total_kib // 2 // max(1, devices)


def keyslot_pbkdf(pbkdf, share_kib):
    """The policy a new keyslot is made with: the pillar's ``pbkdf``, its argon2 memory (the
    pillar's, else cryptsetup's default) at most ``share_kib``."""
    made = dict(pbkdf)
    if share_kib is None or made.get("type", "argon2id") not in MEMORY_HARD:
        return made
    asked = made.get("memory_kib", CRYPTSETUP_ARGON2_MEMORY_KIB)
    made["memory_kib"] = max(ARGON2_MIN_KIB, min(asked, share_kib))
    return made


def describe(pbkdf):
    """``argon2id, at most 65536 KiB of memory``, ``pbkdf2-sha256``: a pbkdf policy, for a
    state's comment (cryptsetup's benchmark may choose less memory)."""
    kind = name({"type": pbkdf.get("type", "argon2id"), "hash": pbkdf.get("hash")})
    if "memory_kib" in pbkdf and kind in MEMORY_HARD:
        return f"{kind}, at most {pbkdf['memory_kib']} KiB of memory"
    return kind


def plan_crypt_names(volumes):
    """The crypt devices of a plan's volumes that systemd opens at boot (``volumes``: the plan's,
    normalised). A volume whose key Salt writes after the boot has ``noauto`` lines: Salt opens
    its devices one after another."""
    return {
        crypt["name"]
        for volume in volumes.values()
        if not NOT_AT_BOOT & set(volume["crypttab_options"])
        for crypt in volume["crypt"]
    }


def boot_crypt_names(plan_names, crypttab):
    """The LUKS devices systemd opens at boot: the plan's (``plan_names``, once built) and the
    crypttab lines that need a keyslot and have no ``noauto``. ``crypttab``: core.tab's parsed
    entries, or an error fact (then the plan's alone)."""
    names = set(plan_names)
    if isinstance(crypttab, list):
        names |= {e["name"] for e in crypttab if not (NOT_AT_BOOT | NO_KDF) & set(e.get("options", []))}
    return names


def above_share(keyslots, share_kib):
    """``[(keyslot id, memory KiB)]`` of the argon2 keyslots that need more than ``share_kib``."""
    if share_kib is None:
        return []
    return [
        (slot["id"], slot["kdf"]["memory"])
        for slot in keyslots
        if derived_at_boot(slot)
        and slot["kdf"]["type"] in MEMORY_HARD
        and slot["kdf"].get("memory", 0) > share_kib
    ]


def derived_at_boot(slot):
    """Does an unlock with any keyslot (systemd-cryptsetup's) derive this one's key? Not a
    keyslot of priority ignore, nor one bound to no volume key (luksAddKey --unbound), nor a
    re-encryption's (no KDF)."""
    return (
        slot.get("kdf") is not None
        and slot.get("priority", 1) != PRIORITY_IGNORE
        and slot.get("volume_key", "") is not None
    )


# What a host in FIPS mode opens: PBKDF2 with a SHA-2 hash (NIST SP 800-132); cryptsetup
# refuses argon2 there, not a FIPS-approved KDF. The formula makes SHA-256 keyslots: cryptsetup's
# default, and its PBKDF2 benchmark with SHA-512 fails in FIPS mode (SLE Micro 6.1, longhorn
# #12721). cryptsetup makes no PBKDF2 keyslot below 1000 iterations.
FIPS_HASHES = ("sha256", "sha384", "sha512")
FIPS_PBKDF = {"type": "pbkdf2", "hash": "sha256"}
PBKDF2_MIN_ITERATIONS = 1000


def name(kdf):
    """``pbkdf2-sha256``, ``argon2id``: a keyslot's KDF by the names FIPS rules use."""
    return f"{kdf['type']}-{kdf['hash']}" if kdf.get("hash") else kdf["type"]


def fips_usable(kdf):
    """Does a host in FIPS mode open a keyslot of this ``kdf`` (parsed from its header)?"""
    return kdf["type"] == "pbkdf2" and kdf.get("hash") in FIPS_HASHES


def not_fips_usable(keyslots):
    """``[(keyslot id, its KDF)]`` of the keyslots a boot derives that FIPS mode refuses."""
    return [
        (slot["id"], slot["kdf"])
        for slot in keyslots
        if derived_at_boot(slot) and not fips_usable(slot["kdf"])
    ]


def weaker(kdf, minimum):
    """Is a keyslot's ``kdf`` (parsed from its header) weaker than the policy's ``minimum``
    (compliance:min_pbkdf)?"""
    if STRENGTH.get(kdf["type"], -1) < STRENGTH[minimum.get("type", "argon2i")]:
        return True
    if kdf["type"] == "pbkdf2":
        return kdf.get("iterations", 0) < minimum.get("iterations", 0)
    return kdf.get("memory", 0) < minimum.get("memory_kib", 0) or kdf.get("time", 0) < minimum.get("time", 0)


def share_below_policy(pbkdf, minimum, share_kib):
    """Would the boot share force an argon2 keyslot below the audit's minimum memory (whatever
    its minimum type: kdf.weaker holds every argon2 keyslot to it) or below what cryptsetup
    accepts? That floor, or None."""
    if share_kib is None or pbkdf.get("type", "argon2id") not in MEMORY_HARD:
        return None
    floor = max(ARGON2_MIN_KIB, minimum.get("memory_kib", 0))
    return floor if floor > share_kib else None
