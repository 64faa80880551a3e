"""Command lines for cryptsetup, mkfs.xfs and wipefs, from the plan. Pure code.

Keys are only ever named by their file (``--key-file <path>``): no argv built here can hold key
material, which keeps it out of /proc/<pid>/cmdline, `ps`, Salt's command logs and job data.
"""

import json

SECTOR = 512
LUKS2_DEFAULT_DATA_OFFSET = 16 << 20  # cryptsetup's LUKS2 header + keyslots area
LUKS2_METADATA_SIZE = "128k"  # each of the two copies of the LUKS2 header and its JSON


def luks_data_offset(stripe_kib, stripes):
    """Data offset (512-byte sectors) that starts the payload on a full stripe, or None when
    cryptsetup's 16 MiB default already does (it does for every power-of-two stripe width)."""
    width = stripe_kib * 1024 * stripes
    if width <= 0 or LUKS2_DEFAULT_DATA_OFFSET % width == 0:
        return None
    return -(-LUKS2_DEFAULT_DATA_OFFSET // width) * width // SECTOR


def pbkdf_args(pbkdf):
    args = ["--pbkdf", pbkdf.get("type", "argon2id")]
    for key, flag in (
        ("iter_time_ms", "--iter-time"),
        ("memory_kib", "--pbkdf-memory"),
        ("parallel", "--pbkdf-parallel"),
        ("force_iterations", "--pbkdf-force-iterations"),
        ("hash", "--hash"),  # PBKDF2's (FIPS mode: sha256)
    ):
        if key in pbkdf:
            args += [flag, str(pbkdf[key])]
    return args


def luks_format(device, key_file, luks, label=None, offset_sectors=None, uuid=None):
    argv = [
        "cryptsetup",
        "luksFormat",
        "--batch-mode",
        "--type",
        luks["type"],
        "--cipher",
        luks["cipher"],
        "--key-size",
        str(luks["key_size"]),
        "--sector-size",
        str(luks["sector_size"]),
        # room for two Clevis tokens of up to 16 Tang servers and a TPM2 (about 1 KiB and 2.4 KiB
        # a server each): a binding is replaced by binding anew, then removing the old one (the
        # default 16 KiB holds 12 KiB of JSON); the data offset stays where it was
        "--luks2-metadata-size",
        LUKS2_METADATA_SIZE,
        *pbkdf_args(luks.get("pbkdf", {})),
        "--key-file",
        key_file,
    ]
    if label:
        argv += ["--label", label]
    if offset_sectors:
        argv += ["--offset", str(offset_sectors)]
    if uuid:
        argv += ["--uuid", uuid]
    return [*argv, device]


def luks_open(name, device, key_file, flag_options, persistent):
    """``flag_options``: cryptsetup's spelling of the dm-crypt flags to set (the plan's
    ``luks.flags``), exactly these."""
    argv = ["cryptsetup", "open", "--type", "luks2", "--key-file", key_file, *sorted(flag_options)]
    return [*argv, *(["--persistent"] if persistent else []), device, name]


def luks_refresh(name, key_file, flag_options, persistent):
    argv = ["cryptsetup", "refresh", "--key-file", key_file, *sorted(flag_options)]
    return [*argv, *(["--persistent"] if persistent else []), name]


def luks_resize(name, key_file):
    """The open crypt device ``name`` to the whole of the device under it (after the LV grew)."""
    return ["cryptsetup", "resize", "--key-file", key_file, name]


def xfs_grow(mountpoint):
    """The mounted XFS at ``mountpoint`` to the whole of its device, online."""
    return ["xfs_growfs", "-d", mountpoint]


def luks_add_key(device, key_file, new_key_file, pbkdf):
    """A new keyslot for the key in ``new_key_file``, authorised by the key in ``key_file``
    (an existing keyslot's), with the policy's PBKDF."""
    return [
        "cryptsetup",
        "luksAddKey",
        "--batch-mode",
        *pbkdf_args(pbkdf),
        "--key-file",
        key_file,
        device,
        new_key_file,
    ]


def luks_convert_key(device, keyslot, key_file, pbkdf):
    """Make keyslot ``keyslot`` again with the policy's PBKDF, opened by the key in ``key_file``
    (the same key, the same keyslot number)."""
    return [
        "cryptsetup",
        "luksConvertKey",
        "--batch-mode",
        "--key-slot",
        str(keyslot),
        *pbkdf_args(pbkdf),
        "--key-file",
        key_file,
        device,
    ]


def luks_kill_slot(device, keyslot, key_file):
    """Remove keyslot ``keyslot`` once cryptsetup has checked that the key in ``key_file`` opens
    another keyslot. It does not check that for the last keyslot (it removes it): the caller
    must know the key opens another one."""
    return ["cryptsetup", "luksKillSlot", "--batch-mode", "--key-file", key_file, device, str(keyslot)]


def clevis_config(policy):
    """(pin, config) of ``clevis luks bind`` for the plan's ``key.clevis`` (pillar.clevis_policy).
    Tang: the tang pin for one server, Shamir's sss over tang pins for several; each server comes
    with its thumbprint, so Clevis checks the advertisement's signature instead of asking whether
    to trust it. TPM2: the tpm2 pin sealed to the PCRs named. Both: an sss needing both shares,
    the TPM2's and the Tang part's (the disk opens on this machine inside this network only)."""
    pins = {}
    if policy["tang"]:
        tang = policy["tang"]
        servers = [{"url": s["url"], "thp": s["thumbprint"]} for s in tang["servers"]]
        if len(servers) == 1 and tang["threshold"] == 1:
            pins["tang"] = servers[0]
        else:
            pins["sss"] = {"t": tang["threshold"], "pins": {"tang": servers}}
    if policy["tpm2"]:
        tpm2 = {}
        if policy["tpm2"]["pcr_ids"]:
            tpm2["pcr_bank"] = policy["tpm2"]["pcr_bank"]
            tpm2["pcr_ids"] = ",".join(str(i) for i in policy["tpm2"]["pcr_ids"])
        pins["tpm2"] = tpm2
    if len(pins) == 1:
        [(pin, config)] = pins.items()
        return pin, json.dumps(config, sort_keys=True)
    return "sss", json.dumps({"t": len(pins), "pins": pins}, sort_keys=True)


def clevis_bind(device, key_file, policy):
    """Bind ``device`` to the Clevis ``policy`` with a new keyslot; ``key_file`` (an existing
    keyslot's key) is named, never passed. No ``-y``: nothing is trusted without a thumbprint."""
    pin, config = clevis_config(policy)
    return ["clevis", "luks", "bind", "-d", device, "-k", key_file, pin, config]


def clevis_decrypt():
    """Decrypt the compact JWE on stdin (one pin's share, e.g. a TPM2 unseal); the secret goes
    to stdout, which the caller discards: only whether it decrypts matters."""
    return ["clevis", "decrypt"]


def luks_token_import(device):
    """Add the LUKS2 token read from stdin (JSON) to ``device``'s header."""
    return ["cryptsetup", "token", "import", device]


def luks_token_remove(device, token_id):
    return ["cryptsetup", "token", "remove", "--token-id", str(token_id), device]


def clevis_unbind(device, keyslot):
    """Remove a Clevis binding: its token and keyslot (``-f``: no question asked)."""
    return ["clevis", "luks", "unbind", "-d", device, "-s", str(keyslot), "-f"]


def luks_header_backup(device, backup):
    """A copy of the whole LUKS header (both copies and the keyslot area) into a new file."""
    return ["cryptsetup", "luksHeaderBackup", device, "--header-backup-file", backup]


def mkfs_xfs(device, stripe_kib, stripes, options, force=False):
    """mkfs.xfs aligned to the stripe (su = stripe size, sw = number of stripes)."""
    argv = ["mkfs.xfs", "-q"]
    if force:
        argv.append("-f")  # only ever for a device the guard cleared (interrupted mkfs, allowed wipe)
    if stripes > 1:
        argv += ["-d", f"su={stripe_kib}k,sw={stripes}"]
    for option in options:
        argv += option.split(None, 1)
    return [*argv, device]


def wipe(device):
    return ["wipefs", "--all", device]
