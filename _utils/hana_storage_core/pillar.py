"""Validate and normalise the ``hana:storage`` pillar. Pure code: no I/O.

The pillar is first merged over ``parameters/defaults.yaml`` (``merge``), then checked in three
passes, each error naming its key path (``hana:storage:volumes:log:stripe_size``) and what is allowed:

* ``schema_errors``   - JSON Schema (draft 2020-12); messages are written here, not taken from
  jsonschema, so that a value under ``key:material`` is never echoed;
* ``semantic_errors`` - what a schema cannot say (a device in two volumes, nested mountpoints, ...);
* ``host_errors``     - facts gathered on the minion (missing devices, symlinks to the system disk).

``normalize`` turns a valid config into the plan every state, the audit and the beacon read.
"""

import base64
import binascii
import copy
import posixpath
import re
from typing import NamedTuple

from . import kdf

PREFIX = "hana:storage"
REDACTED = "<redacted>"
RUNTIME_DIR = "/run/hana-storage"  # the formula's own: ramfs for pillar keys and Clevis' scratch
PILLAR_KEY_DIR = f"{RUNTIME_DIR}/keys"
HEADER_BACKUP_SUFFIX = ".luks-header"  # <header_backup.directory>/<crypt name>.luks-header
SPARE_SUFFIX = "_spare"  # the spare LUN's crypt name below LVM: <crypt_name>_spare

# Paths the formula must never mount over or keep keys in.
SYSTEM_PATHS = frozenset(
    [
        "/",
        "/bin",
        "/boot",
        "/dev",
        "/etc",
        "/home",
        "/lib",
        "/lib64",
        "/opt",
        "/proc",
        "/root",
        "/run",
        "/sbin",
        "/srv",
        "/sys",
        "/tmp",
        "/usr",
        "/var",
    ]
)
# lvcreate accepts a power of two from the page size up to the extent size (4 MiB by default).
STRIPE_MIN_KIB = 4
STRIPE_MAX_KIB = 4096
MIN_KEY_BYTES = 32
# key sources Clevis unlocks at boot (Tang servers, the host's TPM2 or both): no key file of their
# own, a recovery key in a keyslot beside the binding
CLEVIS_SOURCES = ("tang", "tpm2")
DEFAULT_PCR_BANK = "sha256"
# PCRs a binding made while the host runs cannot be sealed to: their value at boot, when the
# disks are opened, is not the one they have later (or anyone can reset them)
RUNTIME_PCRS = {
    10: "IMA extends it with every file measured while the host runs",
    11: "systemd-stub and systemd-pcrphase extend it through the boot, after the disks open",
    15: "systemd extends it with the machine ID and the volume keys it opens",
    16: "it is the debug PCR: anyone can reset it",
    23: "it is the application PCR: anyone can reset it",
}
# mkfs options that would bypass the data-loss guard or fight the stripe alignment done here.
FORBIDDEN_MKFS = {
    "-f": "would overwrite an existing filesystem; use allow_format instead",
    "-K": "skips discards the formula decides on",
}
REMOVED_XFS_OPTIONS = {"barrier", "nobarrier"}
# fstab options that never show in the kernel's view of a mount
USERSPACE_MOUNT_OPTIONS = {
    "defaults",
    "auto",
    "noauto",
    "nofail",
    "user",
    "nouser",
    "users",
    "owner",
    "group",
    "_netdev",
}


class PillarError(ValueError):
    """The pillar cannot be normalised; carries the list of errors."""

    def __init__(self, errors):
        super().__init__("; ".join(errors))
        self.errors = errors


def merge(defaults, pillar):
    """Pillar over defaults: dicts merge recursively, everything else replaces. A key (``key``,
    a volume's ``key``) of another source than the default's replaces it whole: the default key
    file's ``path`` means nothing to a Tang or a pillar key."""
    result = copy.deepcopy(defaults)
    for key, value in (pillar or {}).items():
        if (
            isinstance(value, dict)
            and isinstance(result.get(key), dict)
            and not _other_source(key, result[key], value)
        ):
            result[key] = merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def _other_source(name, default, value):
    return name == "key" and value.get("source", default.get("source")) != default.get("source")


def keypath(*parts):
    return ":".join([PREFIX, *(str(p) for p in parts)])


def _is_secret(path):
    return "material" in path


def _show(value, path):
    if _is_secret(path):
        return REDACTED
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_name(value):
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "list",
        dict: "mapping",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def _help(error):
    """What a value must be, in words: the failing schema's ``description`` (schema.json keeps
    the help next to the rule it explains)."""
    return error.schema.get("description") or f"a string matching {error.validator_value}"


def _schema_message(error):
    """One readable line per jsonschema error; never echoes secrets."""
    path = list(error.absolute_path)
    where = keypath(*path)
    value = error.instance
    kind = error.validator
    if kind == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(value) - set(allowed)) if isinstance(value, dict) else []
        return [f"{keypath(*path, key)}: unknown key; allowed here: {', '.join(allowed)}" for key in extra]
    if kind == "required":
        missing = [key for key in error.validator_value if key not in value]
        return [f"{keypath(*path, key)}: required key is missing" for key in missing]
    if kind == "type":
        return [f"{where}: must be {error.validator_value}, got {_type_name(value)}"]
    if kind in ("enum", "const"):
        allowed = error.validator_value if kind == "enum" else [error.validator_value]
        shown = ", ".join(str(a) for a in allowed)
        return [f"{where}: must be one of: {shown}; got {_show(value, where)}"]
    if kind == "pattern":
        return [f"{where}: must be {_help(error)}; got {_show(value, where)}"]
    if kind == "oneOf":
        return [f"{where}: must be {_help(error)}; got {_show(value, where)}"]
    if kind == "propertyNames":
        return [f"{where}: volume name {_show(value, where)} is not allowed"]
    if kind in ("minimum", "maximum"):
        word = "at least" if kind == "minimum" else "at most"
        return [f"{where}: must be {word} {error.validator_value}; got {_show(value, where)}"]
    if kind == "minItems":
        return [f"{where}: needs at least {error.validator_value} item(s)"]
    if kind == "maxItems":
        return [f"{where}: takes at most {error.validator_value} items"]
    if kind == "minProperties":
        return [f"{where}: needs at least {error.validator_value} entry"]
    if kind == "maxProperties":
        return [f"{where}: takes at most {error.validator_value} entries"]
    if kind == "uniqueItems":
        return [f"{where}: items must be unique"]
    return [f"{where}: invalid ({kind})"]


# A newline or tab inside a name, a path or an option splits the crypttab or fstab line Salt writes
# it into (and Python's ``$``, unlike ECMA-262's, matches before a final newline, so the
# schema's ``^...$`` patterns let ``"hana_data\n"`` through).
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def control_character_errors(value, path=()):
    """Every string of the pillar, keys included, free of control characters."""
    errors = []
    if isinstance(value, dict):
        for key, sub in value.items():
            where = (*path, key)
            if isinstance(key, str) and CONTROL.search(key):
                errors.append(
                    f"{keypath(*path)}: the name {_show(key, keypath(*where))} holds a control character "
                    "(a newline, a tab ...); names are written into crypttab and fstab lines"
                )
                continue
            errors += control_character_errors(sub, where)
    elif isinstance(value, list):
        for index, sub in enumerate(value):
            errors += control_character_errors(sub, (*path, index))
    elif isinstance(value, str) and CONTROL.search(value):
        where = keypath(*path)
        errors.append(
            f"{where}: must not hold a control character (a newline, a tab ...): it would split the "
            f"crypttab or fstab line it is written into; got {_show(value, where)}"
        )
    return errors


def schema_errors(config, schema):
    """JSON Schema errors as readable ``path: message`` lines, sorted by path."""
    import jsonschema  # imported here so the module loads (and __virtual__ reports) without it

    validator = jsonschema.Draft202012Validator(schema)
    lines = []
    for error in validator.iter_errors(config):
        # if/then and oneOf wrap their own errors: report the innermost, most precise ones
        if error.validator in ("allOf", "if", "then") and error.context:
            for sub in error.context:
                lines.extend(_schema_message(sub))
            continue
        lines.extend(_schema_message(error))
    return sorted(set(lines))


def parse_kib(value):
    """Stripe size in KiB from an int (KiB) or '256k' / '1m'."""
    if isinstance(value, int):
        return value
    text = str(value).strip().lower()
    if text.endswith("m"):
        return int(text[:-1]) * 1024
    return int(text.rstrip("k"))


def _is_under(path, parent):
    return path != parent and path.startswith(parent.rstrip("/") + "/")


def _setting(config, volume_name, key):
    """(value, key path) of a per-volume setting, falling back to volume_defaults."""
    volume = config["volumes"][volume_name]
    if key in volume:
        return volume[key], ("volumes", volume_name, key)
    return config.get("volume_defaults", {}).get(key), ("volume_defaults", key)


def _in_place_errors(config, name, volume):
    """encrypt_in_place takes one of the two routes the formula proves, opened by a key the host
    holds (a key file or the pillar's key): above LVM the XFS on the LV is encrypted where it
    is (inplace.py); below LVM each PV's extents move onto a LUKS PV, through a spare LUN
    (moves.py)."""
    below = _setting(config, name, "encryption")[0] == "below_lvm"
    spare = volume.get("in_place_spare")
    if spare is not None and not (below and volume.get("encrypt_in_place")):
        return [
            f"{keypath('volumes', name, 'in_place_spare')}: a spare LUN is for the encryption in place "
            "below LVM only (encryption: below_lvm and encrypt_in_place: true)"
        ]
    if not volume.get("encrypt_in_place"):
        return []
    where = keypath("volumes", name, "encrypt_in_place")
    if below and spare is None:
        return [
            f"{where}: below LVM each PV's extents move (pvmove) onto a LUKS PV through a spare LUN: "
            f"name a blank LUN at least as large as the largest device in "
            f"{keypath('volumes', name, 'in_place_spare')}, or encrypt above LVM in place "
            "(encryption: above_lvm)"
        ]
    if below and spare in volume.get("devices", []):
        return [f"{keypath('volumes', name, 'in_place_spare')}: {spare} is one of the volume's devices"]
    key = volume.get("key", config.get("key", {}))
    if isinstance(key.get("previous"), dict):
        return [
            f"{where}: the key is being rotated (key:previous): rotate before or after the encryption in "
            "place, not during it (the encryption runs with one key; remove encrypt_in_place once "
            "hana_storage.audit no longer reports it under way)"
        ]
    source = key.get("source")
    if source in CLEVIS_SOURCES:
        return [
            f"{where}: the key source {source} binds through Clevis, which the formula does only once "
            "a volume is encrypted: encrypt in place with a keyfile or pillar key, then change the "
            "volume's key source"
        ]
    return []


def _reencrypt_errors(config, name, volume):
    """reencrypt_online re-encrypts with the key's keyslot alone (reencrypt.reencrypt_init):
    every other keyslot is dropped when it ends, so neither a Clevis binding nor a rotation's
    previous key may be there; and it is for volumes the formula encrypted, not one it is
    encrypting in place. Below LVM each PV gets a new volume key and keeps its sector size
    (reencrypt.wants says why)."""
    if not volume.get("reencrypt_online"):
        return []
    where = keypath("volumes", name, "reencrypt_online")
    key = volume.get("key", config.get("key", {}))
    if volume.get("encrypt_in_place"):
        return [f"{where}: the volume is encrypted in place (encrypt_in_place): re-encrypt it once that ends"]
    if isinstance(key.get("previous"), dict):
        return [
            f"{where}: the key is being rotated (key:previous): the re-encryption keeps only the key's own "
            "keyslot; rotate before or after it"
        ]
    if key.get("source") in CLEVIS_SOURCES:
        return [
            f"{where}: the key source {key.get('source')} binds through Clevis, and a re-encryption keeps "
            "only the recovery key's keyslot: the formula does not yet bind again afterwards"
        ]
    return []


def _key_paths(key, where):
    """[(a key file's path or None, its key path)]: the key's and its previous key's; a Clevis
    key's (Tang, TPM2) files are its recovery key's."""
    if key.get("source") in CLEVIS_SOURCES and isinstance(key.get("recovery"), dict):
        return _key_paths(key["recovery"], (*where, "recovery"))
    paths = [(key.get("path"), (*where, "path"))]
    if isinstance(key.get("previous"), dict):
        paths.append((key["previous"].get("path"), (*where, "previous", "path")))
    return paths


def _decoded(material):
    """The bytes of base64 key material, or None when it is not base64."""
    try:
        return base64.b64decode(material, validate=True)
    except (binascii.Error, ValueError):
        return None


def _previous_key_errors(key, previous, where):
    """A previous key (the one being rotated away) must be another key than the volume's: were
    they the same, removing the previous key's keyslot would remove the key's."""
    source = previous["source"]
    if source == "keyfile" and "material" in previous:
        return [f"{keypath(*where, 'material')}: not used with source keyfile; remove it from the pillar"]
    if source == "pillar" and _decoded(previous.get("material", "")) is None:
        return [f"{keypath(*where, 'material')}: must be base64 (the value is not shown)"]
    same = (
        source == "keyfile" and key.get("source") == "keyfile" and previous.get("path") == key.get("path")
    ) or (
        source == "pillar"
        and key.get("source") == "pillar"
        and _decoded(previous["material"]) == _decoded(key.get("material", ""))
    )
    if same:
        return [
            f"{keypath(*where)}: is the key itself; name the key being rotated away here and the new "
            "key in its place (the values are not shown)"
        ]
    return []


def _key_errors(key, where):
    errors = []
    source = key.get("source")
    if source in CLEVIS_SOURCES:
        for field in ("path", "material", "previous"):
            if field in key:
                errors.append(
                    f"{keypath(*where, field)}: not used with source {source} (the recovery key has its own)"
                )
        for index, pcr in enumerate((key.get("tpm2") or {}).get("pcr_ids", [])):
            if pcr in RUNTIME_PCRS:
                errors.append(
                    f"{keypath(*where, 'tpm2', 'pcr_ids', index)}: PCR {pcr} cannot seal a disk key: "
                    f"{RUNTIME_PCRS[pcr]} (PCR 7, the Secure Boot state, is the usual one)"
                )
        if source == "tpm2":
            for field in ("servers", "threshold"):
                if field in key:
                    errors.append(
                        f"{keypath(*where, field)}: only used with source tang (Tang and the TPM2 "
                        "together: source tang with a tpm2 policy)"
                    )
            return errors + _key_errors(key["recovery"], (*where, "recovery"))
        servers = key.get("servers", [])
        threshold = key.get("threshold", 1)
        if threshold > len(servers):
            errors.append(
                f"{keypath(*where, 'threshold')}: {threshold} servers must answer, but only "
                f"{len(servers)} are named"
            )
        for field in ("url", "thumbprint"):
            seen = set()
            for index, server in enumerate(servers):
                if server[field] in seen:
                    errors.append(f"{keypath(*where, 'servers', index, field)}: named twice")
                seen.add(server[field])
        return errors + _key_errors(key["recovery"], (*where, "recovery"))
    if key.get("source") == "pillar":
        raw = _decoded(key.get("material", ""))
        if raw is None:
            return [f"{keypath(*where, 'material')}: must be base64 (the value is not shown)"]
        if len(raw) < MIN_KEY_BYTES:
            errors.append(
                f"{keypath(*where, 'material')}: must decode to at least {MIN_KEY_BYTES} bytes "
                f"of key material; got {len(raw)} (the value is not shown)"
            )
    elif key.get("source") == "keyfile" and "material" in key:
        errors.append(
            f"{keypath(*where, 'material')}: not used with source keyfile; remove it from the pillar"
        )
    for field in ("servers", "threshold", "recovery", "tpm2"):
        if field in key:
            errors.append(f"{keypath(*where, field)}: only used with source tang or tpm2")
    if isinstance(key.get("previous"), dict):
        errors += _previous_key_errors(key, key["previous"], (*where, "previous"))
    return errors


def semantic_errors(config, fixable=None):
    """What the schema cannot express. Assumes schema_errors() returned nothing. ``fixable``: the
    rules with a fix in the rule table (hana_storage_rules.auto_rules), which alone remediation
    may be allowed."""
    errors = []
    allowed = config.get("compliance", {}).get("remediation", {}).get("rules", [])
    for index, rule in enumerate(allowed if fixable is not None else []):
        if rule not in fixable:
            errors.append(
                f"{keypath('compliance', 'remediation', 'rules', index)}: {rule} has no safe fix; "
                f"remediation can fix {', '.join(fixable)}"
            )
    volumes = config["volumes"]
    key_paths = []
    if config.get("key"):
        errors += _key_errors(config["key"], ("key",))
        key_paths += _key_paths(config["key"], ("key",))
    errors += _options_errors(config.get("volume_defaults", {}), ("volume_defaults",))
    if config.get("compliance", {}).get("fips"):
        errors += _fips_errors(config, "compliance:fips says the host is about to run in FIPS mode")
    errors += _pbkdf2_errors(config["luks"].get("pbkdf", {}))

    device_owner, mountpoints, names = {}, {}, {}
    for name, volume in volumes.items():
        for index, device in enumerate(volume["devices"]):
            where = keypath("volumes", name, "devices", index)
            if posixpath.normpath(device) != device or "/./" in device:
                errors.append(
                    f"{where}: must be a normalised path (no '..', '.', '//' or trailing '/'); got {device!r}"
                )
            if device in device_owner:
                errors.append(
                    f"{where}: {device} is already used by volume {device_owner[device]!r}; "
                    f"a device belongs to one volume only"
                )
            device_owner.setdefault(device, name)
        spare = volume.get("in_place_spare")
        if spare is not None and device_owner.setdefault(spare, name) != name:
            errors.append(
                f"{keypath('volumes', name, 'in_place_spare')}: {spare} is already used by volume "
                f"{device_owner[spare]!r}; a device belongs to one volume only"
            )
        for index, device in enumerate(volume.get("allow_format", [])):
            if device not in volume["devices"]:
                errors.append(
                    f"{keypath('volumes', name, 'allow_format', index)}: {device} is not one of "
                    f"this volume's devices"
                )

        mountpoint = volume["mountpoint"]
        where = keypath("volumes", name, "mountpoint")
        if posixpath.normpath(mountpoint) != mountpoint:
            errors.append(
                f"{where}: must be a normalised path (no '..', '//' or trailing '/'); got {mountpoint!r}"
            )
        elif mountpoint in SYSTEM_PATHS:
            errors.append(
                f"{where}: {mountpoint} is a system directory; HANA volumes go below it, e.g. /hana/data"
            )
        mountpoints[name] = mountpoint

        stripes = volume.get("stripes", len(volume["devices"]))
        if len(volume["devices"]) % stripes:
            errors.append(
                f"{keypath('volumes', name, 'devices')}: {len(volume['devices'])} devices cannot carry "
                f"{stripes} stripes evenly: give it a multiple of {stripes} devices "
                f"({', '.join(str(stripes * k) for k in _multiples_near(len(volume['devices']), stripes))})"
            )

        errors += _in_place_errors(config, name, volume)
        errors += _reencrypt_errors(config, name, volume)

        stripe, origin = _setting(config, name, "stripe_size")
        kib = parse_kib(stripe)
        if kib < STRIPE_MIN_KIB or kib > STRIPE_MAX_KIB or kib & (kib - 1):
            errors.append(
                f"{keypath(*origin)}: must be a power of two between {STRIPE_MIN_KIB} KiB and "
                f"{STRIPE_MAX_KIB} KiB (LVM's limits with 4 MiB extents); got {kib} KiB"
            )

        errors += _options_errors(volume, ("volumes", name))
        if "key" in volume:
            errors += _key_errors(volume["key"], ("volumes", name, "key"))
            key_paths += _key_paths(volume["key"], ("volumes", name, "key"))

        plan = _names(name, volume, _setting(config, name, "encryption")[0])
        for kind, value in plan.items():
            for item in value if isinstance(value, list) else [value]:
                owner = names.setdefault((kind, item), name)
                if owner != name:
                    errors.append(
                        f"{keypath('volumes', name, kind if kind != 'crypt' else 'crypt_name')}: "
                        f"{kind} name {item!r} is also used by volume {owner!r}"
                    )

    seen = {}
    for name, mountpoint in sorted(mountpoints.items(), key=lambda item: item[1]):
        where = keypath("volumes", name, "mountpoint")
        for other, other_mp in seen.items():
            if mountpoint == other_mp:
                errors.append(f"{where}: {mountpoint} is also the mountpoint of volume {other!r}")
            elif _is_under(mountpoint, other_mp):
                errors.append(
                    f"{where}: {mountpoint} is nested inside {other_mp} (volume {other!r}); "
                    f"HANA volumes must be separate mountpoints"
                )
        seen[name] = mountpoint

    for path, origin in key_paths:
        if not path:
            continue
        if posixpath.normpath(path) != path:
            errors.append(f"{keypath(*origin)}: must be a normalised path; got {path!r}")
        if _is_under(path, RUNTIME_DIR):
            errors.append(
                f"{keypath(*origin)}: {path} lies in {RUNTIME_DIR}, where the formula mounts RAM file "
                "systems of its own (pillar keys, Clevis' scratch): put the key store's key files elsewhere"
            )
        if _is_formula_file(path, config):
            errors.append(
                f"{keypath(*origin)}: {path} is a name the formula writes its own files under (header "
                f"backups *{HEADER_BACKUP_SUFFIX} and their *.new, *.hana-storage.new): it would replace the key"
            )
        for name, mountpoint in mountpoints.items():
            if path == mountpoint or _is_under(path, mountpoint):
                errors.append(
                    f"{keypath(*origin)}: {path} lies inside the HANA mountpoint {mountpoint} "
                    f"(volume {name!r}); a key must never sit on the device it unlocks"
                )
    errors += _header_backup_errors(config, mountpoints)
    return errors


def _is_formula_file(path, config):
    """Is ``path`` a file the formula writes: a header backup or its temporary, or the temporary
    of an atomic write (core.files)?"""
    name = posixpath.basename(path)
    if name.endswith(".hana-storage.new"):
        return True
    directory = (config.get("header_backup") or {}).get("directory")
    return bool(directory) and (
        posixpath.dirname(path) == posixpath.normpath(directory)
        and (name.endswith(HEADER_BACKUP_SUFFIX) or name.endswith(HEADER_BACKUP_SUFFIX + ".new"))
    )


# Where a header backup is gone at the next boot, when it is needed most.
VOLATILE_PATHS = ("/run", "/tmp", "/dev", "/proc", "/sys", "/var/run")
VOLATILE_FSTYPES = frozenset({"tmpfs", "ramfs", "devtmpfs", "proc", "sysfs"})


def _header_backup_errors(config, mountpoints, real=None, fstype=None):
    """A header backup must outlive the device it backs up: not on a HANA volume (the very device,
    or its neighbour in the same stack) and not on a file system the next boot empties.
    ``real``/``fstype``: where the directory really leads on the host (host checks)."""
    directory = (config.get("header_backup") or {}).get("directory")
    if not directory:
        return []
    where = keypath("header_backup", "directory")
    errors = []
    for path in {posixpath.normpath(directory), real} - {None}:
        for name, mountpoint in sorted(mountpoints.items()):
            if path == mountpoint or _is_under(path, mountpoint):
                errors.append(
                    f"{where}: {directory} lies inside the HANA mountpoint {mountpoint} (volume {name!r}): "
                    "a backup on the device it backs up is lost with it; keep it on the root file system "
                    "and copy it off the host"
                )
        if any(path == v or _is_under(path, v) for v in VOLATILE_PATHS) or fstype in VOLATILE_FSTYPES:
            errors.append(
                f"{where}: {directory} is gone at the next boot ({fstype or 'a RAM file system'}): keep "
                "header backups on a persistent file system, e.g. /var/lib/hana-storage/luks-headers"
            )
            break
    return sorted(set(errors))


def _options_errors(settings, where):
    errors = []
    for index, option in enumerate(settings.get("mount_options", [])):
        if option.split("=", 1)[0] in REMOVED_XFS_OPTIONS:
            errors.append(
                f"{keypath(*where, 'mount_options', index)}: '{option}' was removed from XFS in "
                f"Linux 4.19 and would fail the mount; drop it (XFS always uses cache flushes)"
            )
    for index, option in enumerate(settings.get("mkfs_options", [])):
        flag = option.split(" ", 1)[0]
        if flag in FORBIDDEN_MKFS:
            errors.append(f"{keypath(*where, 'mkfs_options', index)}: '{flag}' {FORBIDDEN_MKFS[flag]}")
        if option.startswith("-d") and ("su=" in option or "sw=" in option or "sunit=" in option):
            errors.append(
                f"{keypath(*where, 'mkfs_options', index)}: stripe alignment (su/sw) is derived "
                f"from stripe_size and the device count; remove it"
            )
        if option.startswith("-d") and re.search(r"(^|[ ,])size=", option[2:]):
            errors.append(
                f"{keypath(*where, 'mkfs_options', index)}: the XFS fills its volume (the formula "
                "grows it with the volume, and XFS cannot shrink); size the volume instead (size)"
            )
    return errors


def _multiples_near(count, stripes):
    """The multiples of ``stripes`` around ``count`` (in units of ``stripes``)."""
    if count % stripes == 0:
        return [count // stripes]
    low = max(count // stripes, 1)
    return [low, low + 1]


def _growth_errors(config, lvs):
    """An existing LV grows only in its own stripes: a pillar that gives it more devices in
    another stripe count is refused before any device is touched. ``lvs``: {lv path: {"stripes",
    "pvs"}} of the volumes' LVs that exist (hana_storage_host.lv_geometry)."""
    errors = []
    for name, volume in config["volumes"].items():
        path = lv_path(name, volume)
        found = lvs.get(path)
        devices = len(volume["devices"])
        stripes = volume.get("stripes", devices)
        # a first segment without stripes (error, zero, thin) is no geometry to keep
        if not found or found["stripes"] < 1 or devices <= found["pvs"]:
            continue
        have = found["stripes"]
        stripe_bytes = parse_kib(_setting(config, name, "stripe_size")[0]) * 1024
        if have == stripes and have > 1 and found["stripe_size"] != stripe_bytes:
            errors.append(
                f"{keypath('volumes', name, 'stripe_size')}: {path} has stripes "
                f"of {found['stripe_size'] // 1024} KiB; its new devices would add a segment of "
                f"{stripe_bytes // 1024} KiB: set stripe_size: {found['stripe_size'] // 1024}"
            )
            continue
        if have == stripes:
            continue
        errors.append(
            f"{keypath('volumes', name, 'stripes')}: {path} has {have} stripe(s) "
            f"over {found['pvs']} devices; {devices - found['pvs']} new device(s) in {stripes} stripes would "
            f"add a {stripes}-stripe segment: set stripes: {have} and give it a multiple of {have} devices "
            f"({', '.join(str(have * k) for k in _multiples_near(devices, have))})"
        )
    return errors


def host_errors(config, facts):
    """Checks against facts gathered on the minion.

    ``facts`` = {"devices": {path: {"exists": bool, "block": bool, "realpath": str}},
                 "system_devices": [realpaths of disks/partitions holding /, /boot, /usr, /var, swap],
                 "paths": {directory: {"realpath": where it leads, "fstype": of the file system there}}}
    """
    errors = []
    system = set(facts.get("system_devices", []))
    realpaths = {}
    for name, volume in config["volumes"].items():
        for index, device in enumerate(volume["devices"]):
            where = keypath("volumes", name, "devices", index)
            fact = facts.get("devices", {}).get(device, {})
            if not fact.get("exists"):
                errors.append(f"{where}: {device} does not exist on this host")
                continue
            if not fact.get("block"):
                errors.append(f"{where}: {device} is not a block device")
                continue
            real = fact.get("realpath", device)
            if real in system:
                via = f" (via symlink to {real})" if real != device else ""
                errors.append(f"{where}: {device}{via} holds the running system; refusing to use it")
            if real in realpaths and realpaths[real][0] != where:
                errors.append(f"{where}: {device} is the same disk as {realpaths[real][1]} ({real})")
            realpaths.setdefault(real, (where, device))
    errors += _growth_errors(config, facts.get("lvs", {}))
    errors += _boot_memory_errors(config, facts)
    if facts.get("fips") is True:
        errors += _fips_errors(config, "this host runs in FIPS mode")
    directory = (config.get("header_backup") or {}).get("directory")
    fact = facts.get("paths", {}).get(directory) if directory else None
    if fact:
        mountpoints = {name: volume["mountpoint"] for name, volume in config["volumes"].items()}
        errors += _header_backup_errors(config, mountpoints, fact.get("realpath"), fact.get("fstype"))
    return errors


def _pbkdf2_errors(pbkdf):
    """What cryptsetup refuses in a PBKDF2 policy."""
    if pbkdf.get("type") != "pbkdf2":
        return []
    errors = [
        f"{keypath('luks', 'pbkdf', key)}: PBKDF2 has no {what}; leave it out"
        for key, what in (("memory_kib", "memory cost"), ("parallel", "threads"))
        if key in pbkdf
    ]
    if pbkdf.get("force_iterations", kdf.PBKDF2_MIN_ITERATIONS) < kdf.PBKDF2_MIN_ITERATIONS:
        errors.append(
            f"{keypath('luks', 'pbkdf', 'force_iterations')}: cryptsetup makes PBKDF2 keyslots with "
            f"{kdf.PBKDF2_MIN_ITERATIONS} iterations or more (NIST SP 800-132)"
        )
    return errors


def _fips_errors(config, why):
    """What a host in FIPS mode cannot do: make an argon2 keyslot, or call PBKDF2 ones weak."""
    errors = []
    if config["luks"].get("pbkdf", {}).get("type", "argon2id") != "pbkdf2":
        errors.append(
            f"{keypath('luks', 'pbkdf', 'type')}: {why}, where cryptsetup makes and opens only PBKDF2 keyslots: set pbkdf2"
        )
    if config.get("compliance", {}).get("min_pbkdf", {}).get("type", "argon2i") != "pbkdf2":
        errors.append(
            f"{keypath('compliance', 'min_pbkdf', 'type')}: {why}: every keyslot is PBKDF2 there; set pbkdf2"
        )
    return errors


def _boot_memory_errors(config, facts):
    """The share of RAM each keyslot gets at boot (core.kdf) against the audit's minimum."""
    ram_kib = (facts.get("memory") or {}).get("total_kib")
    boot = normalize(config, None, ram_kib, facts.get("crypttab"))["luks"]["boot"]
    minimum = config.get("compliance", {}).get("min_pbkdf", {})
    floor = kdf.share_below_policy(config["luks"].get("pbkdf", {}), minimum, boot["share_kib"])
    if floor is None:
        return []
    return [
        f"{keypath('compliance', 'min_pbkdf', 'memory_kib')}: {boot['devices']} LUKS devices open "
        f"together at boot, and half of this host's {ram_kib // 1024} MiB of RAM gives each keyslot "
        f"{boot['share_kib']} KiB, less than the {floor} KiB asked here: lower it, or use "
        "luks:pbkdf:type pbkdf2, fewer devices or a host with more RAM"
    ]


def validate(config, schema, facts=None, fixable=None):
    """All errors for a merged config: schema first; semantic and host checks only on a sound shape."""
    errors = sorted(set(control_character_errors(config) + schema_errors(config, schema)))
    if errors:
        return errors
    errors = semantic_errors(config, fixable)
    if facts is not None and not errors:
        errors = host_errors(config, facts)
    return sorted(errors)


def default_names(name):
    """The names a volume gets unless its pillar names them."""
    return {"vg": f"vg_hana_{name}", "lv": f"lv_hana_{name}", "crypt_name": f"hana_{name}"}


def lv_path(name, volume):
    """``/dev/<vg>/<lv>`` of the volume ``name`` (its pillar's names, else the defaults)."""
    names = {**default_names(name), **volume}
    return f"/dev/{names['vg']}/{names['lv']}"


def _names(name, volume, encryption):
    names = {**default_names(name), **{k: v for k, v in volume.items() if k in ("vg", "lv", "crypt_name")}}
    crypt = names["crypt_name"]
    crypt_names = (
        [f"{crypt}_{i}" for i in range(len(volume["devices"]))] if encryption == "below_lvm" else crypt
    )
    if encryption == "below_lvm" and volume.get("in_place_spare"):
        crypt_names = [*crypt_names, f"{crypt}{SPARE_SUFFIX}"]
    return {"vg": names["vg"], "crypt": crypt_names}


def key_file(key, volume_name=None, previous=False):
    """Where the key of a volume lives on the minion (a Tang volume's: its recovery key);
    ``previous``: where the key being rotated away lives. A pillar key's file is named after
    its owner: ``hana`` for the default key, ``volume-<name>`` for a volume's own (no volume
    name has a hyphen, so none can take the default key's file)."""
    if key["source"] in CLEVIS_SOURCES:
        return key_file(key["recovery"], volume_name, previous)
    secret = key["previous"] if previous else key
    if secret["source"] == "pillar":
        return posixpath.join(
            PILLAR_KEY_DIR, key_owner(volume_name) + (".previous.key" if previous else ".key")
        )
    return secret["path"]


def key_owner(volume_name=None):
    """The name a key goes by in key files and state IDs: ``hana`` (the default key, named
    ``default`` in state IDs) or ``volume-<name>``."""
    return f"volume-{volume_name}" if volume_name else "hana"


# What each key source puts in crypttab's options: a key file unlocks at boot; a pillar key lives
# on ramfs and is there only once Salt wrote it (no unlock or mount at boot); a Tang volume
# unlocks at boot through Clevis once the network is up; a TPM2 volume through Clevis as soon as
# its device is there (key field none for both: Clevis's password agent answers).
AT_BOOT = {"keyfile": [], "pillar": ["noauto"], "tang": ["_netdev"], "tpm2": []}


def clevis_policy(key):
    """What a Clevis key's binding must be: {"tang": {"servers", "threshold"} or None, "tpm2":
    {"pcr_bank", "pcr_ids"} or None}; both: the disk opens only when the TPM2 and the Tang
    threshold both answer. None for a key Clevis does not unlock."""
    if key["source"] not in CLEVIS_SOURCES:
        return None
    tang = tpm2 = None
    if key["source"] == "tang":
        tang = {
            "servers": [{"url": s["url"], "thumbprint": s["thumbprint"]} for s in key["servers"]],
            "threshold": key.get("threshold", 1),
        }
    if "tpm2" in key:
        ids = sorted(key["tpm2"].get("pcr_ids", []))
        # no PCR: this TPM whatever boots, no bank to read (Clevis records none)
        tpm2 = {"pcr_bank": key["tpm2"].get("pcr_bank", DEFAULT_PCR_BANK) if ids else None, "pcr_ids": ids}
    return {"tang": tang, "tpm2": tpm2}


def _volume_key(name, raw, config):
    """The plan's view of a volume's key: where its file is and where that comes from, never
    the material (named by its pillar path instead)."""
    own = "key" in raw
    key = raw["key"] if own else config["key"]
    where = ("volumes", name, "key") if own else ("key",)
    clevis = key["source"] in CLEVIS_SOURCES
    secret, secret_at = (key["recovery"], (*where, "recovery")) if clevis else (key, where)
    planned = {
        "id": key_owner(name) if own else "default",  # one key state per distinct key
        "source": key["source"],
        "file": key_file(key, name if own else None),
        "store": secret["source"],  # where the key file comes from: a key store or the pillar
        "pillar": keypath(*secret_at, "material"),
        "crypttab": "none" if clevis else key_file(key, name if own else None),
        "previous": None,
        "clevis": clevis_policy(key),
    }
    if "previous" in secret:  # a rotation: the key being rotated away, still opening the devices
        planned["previous"] = {
            "file": key_file(key, name if own else None, previous=True),
            "store": secret["previous"]["source"],
            "pillar": keypath(*secret_at, "previous", "material"),
        }
    return planned


def normalize(config, systemd_version=None, ram_kib=None, crypttab=None, host_fips=False):
    """A valid merged config -> the plan: every volume fully spelled out, no key material.

    ``systemd_version``: the host's (its crypttab reader); crypttab options it does not know
    are left out, and the LUKS2 header's persistent flags carry those at boot. ``ram_kib`` and
    ``crypttab`` (parsed): the host's RAM and what its boot opens besides the plan; a keyslot
    the formula makes gets at most its share of the RAM at boot (``luks.boot``, core.kdf).
    ``host_fips``: the host runs in FIPS mode; with ``compliance:fips`` it makes ``luks.fips``:
    keyslots PBKDF2-SHA256, made and audited so.
    """
    volumes = {}
    for name in sorted(config["volumes"]):
        raw = config["volumes"][name]
        volume = merge(config.get("volume_defaults", {}), raw)
        volume["name"] = name
        for field, default in default_names(name).items():
            volume.setdefault(field, default)
        volume.setdefault("allow_format", [])
        volume["encrypt_in_place"] = bool(volume.get("encrypt_in_place"))
        volume["reencrypt_online"] = bool(volume.get("reencrypt_online"))
        volume["stripe_size_kib"] = parse_kib(volume.pop("stripe_size"))
        volume["stripes"] = volume.get("stripes", len(volume["devices"]))
        volume["key"] = _volume_key(name, raw, config)
        volume["lv_path"] = lv_path(name, volume)
        # device-mapper's name for the LV: '-' inside VG and LV names is doubled
        volume["lv_dm_name"] = f"{volume['vg'].replace('-', '--')}-{volume['lv'].replace('-', '--')}"
        if volume["encryption"] == "above_lvm":
            volume["crypt"] = [{"name": volume["crypt_name"], "device": volume["lv_path"]}]
            volume["pvs"] = list(volume["devices"])
            volume["fs_device"] = f"/dev/mapper/{volume['crypt_name']}"
            volume["fs_dm_name"] = volume["crypt_name"]
        else:
            volume["crypt"] = [
                {"name": crypt, "device": device}
                for crypt, device in zip(
                    _names(name, raw, "below_lvm")["crypt"][: len(volume["devices"])],
                    volume["devices"],
                    strict=True,
                )
            ]
            volume["pvs"] = [f"/dev/mapper/{c['name']}" for c in volume["crypt"]]
            if volume["encrypt_in_place"]:
                volume["spare"] = {
                    "name": f"{volume['crypt_name']}{SPARE_SUFFIX}",
                    "device": volume.pop("in_place_spare"),
                }
            volume["fs_device"] = volume["lv_path"]
            volume["fs_dm_name"] = volume["lv_dm_name"]
        backups = config.get("header_backup", {}).get("directory")
        for crypt in volume["crypt"]:
            crypt["header_backup"] = (
                f"{backups.rstrip('/')}/{crypt['name']}{HEADER_BACKUP_SUFFIX}" if backups else None
            )
        # Safe mode off: every device this pillar names may be formatted.
        volume["may_format"] = list(volume["devices"]) if not config["safe_mode"] else volume["allow_format"]
        at_boot = AT_BOOT[volume["key"]["source"]]
        volume["crypttab_options"] = [
            "luks",
            *crypttab_flag_options(config["luks"], systemd_version),
            *at_boot,
        ]
        volume["fstab_options"] = [*volume["mount_options"], *at_boot]
        volume["kernel_mount_options"] = kernel_mount_options(volume["mount_options"])
        volumes[name] = volume
    plan = {k: copy.deepcopy(v) for k, v in config.items() if k not in ("volumes", "volume_defaults", "key")}
    plan["key"] = _without_material(config["key"])
    plan["luks"]["flags"] = crypt_flags(config["luks"])
    plan["luks"]["dm_flags"] = [f["dm"] for f in plan["luks"]["flags"] if f["wanted"]]
    opened_at_boot = kdf.boot_crypt_names(kdf.plan_crypt_names(volumes), crypttab)
    share = kdf.boot_share_kib(ram_kib, len(opened_at_boot))
    plan["luks"]["boot"] = {"ram_kib": ram_kib, "devices": len(opened_at_boot), "share_kib": share}
    plan["luks"]["pbkdf"] = kdf.keyslot_pbkdf(config["luks"].get("pbkdf", {}), share)
    plan["luks"]["fips"] = bool(host_fips or config.get("compliance", {}).get("fips"))
    if plan["luks"]["fips"] and plan["luks"]["pbkdf"].get("type") == "pbkdf2":
        plan["luks"]["pbkdf"]["hash"] = kdf.FIPS_PBKDF["hash"]
    plan["volumes"] = volumes
    return plan


# What a remount changes on a mounted XFS: the VFS's own per-mount and superblock flags, and of
# XFS's options inode32/inode64 only (xfs_fs_reconfigure; newer kernels also attr2). Every other
# XFS option (logbsize, allocsize, largeio, swalloc, discard, wsync, grpid, quotas, dax, ...) a
# remount silently ignores: a mount made without it keeps going without it until mounted anew.
REMOUNTABLE = frozenset(
    {
        "ro", "rw", "atime", "noatime", "diratime", "nodiratime", "relatime", "norelatime",
        "strictatime", "nostrictatime", "lazytime", "nolazytime", "suid", "nosuid", "dev", "nodev",
        "exec", "noexec", "sync", "async", "dirsync", "inode32", "inode64",
    }
)  # fmt: skip


def mount_only(option):
    """``option`` takes effect only when the XFS is mounted, never on a remount."""
    return option.partition("=")[0] not in REMOUNTABLE


def kernel_mount_options(options):
    """The mount options the kernel shows for a mount (userspace-only and x-* options never do)."""
    return [o for o in options if o not in USERSPACE_MOUNT_OPTIONS and not o.startswith(("x-", "comment="))]


class CryptFlag(NamedTuple):
    """A dm-crypt flag the formula decides on, as each layer spells it."""

    dm: str  # the dm table, the plan; the pillar's luks key (luks.perf for the perf flags)
    header: str  # the LUKS2 header's persistent flags
    cryptsetup: str  # the option of cryptsetup open and refresh
    crypttab: str  # the /etc/crypttab option
    crypttab_since_systemd: int  # the first systemd-cryptsetup that knows the crypttab option
    perf: bool  # a HANA performance flag (HANA-PERF-002/003); else a data-path choice


CRYPT_FLAGS = (
    CryptFlag("allow_discards", "allow-discards", "--allow-discards", "discard", 0, perf=False),
    CryptFlag(
        "no_read_workqueue",
        "no-read-workqueue",
        "--perf-no_read_workqueue",
        "no-read-workqueue",
        248,
        perf=True,
    ),
    CryptFlag(
        "no_write_workqueue",
        "no-write-workqueue",
        "--perf-no_write_workqueue",
        "no-write-workqueue",
        248,
        perf=True,
    ),
)


def crypt_flags(luks):
    """Every flag of CRYPT_FLAGS with ``wanted``: whether the LUKS policy asks for it. The plan
    carries this list, so that no layer spells a flag on its own."""
    perf = luks.get("perf", {})
    return [
        {**flag._asdict(), "wanted": bool((perf if flag.perf else luks).get(flag.dm, False))}
        for flag in CRYPT_FLAGS
    ]


def unmanaged_flag_options(header_flags):
    """cryptsetup options that keep the LUKS2 header's persistent flags the formula does not decide
    on (``same-cpu-crypt``, ``submit-from-crypt-cpus``, ...): an admin's choice, which ``open`` or
    ``refresh --persistent`` would otherwise drop, because ``--persistent`` stores exactly the
    flags given. cryptsetup spells each of them ``--perf-<flag>`` with underscores."""
    managed = {flag.header for flag in CRYPT_FLAGS}
    return [f"--perf-{flag.replace('-', '_')}" for flag in header_flags if flag not in managed]


def crypttab_flag_options(luks, systemd_version=None):
    """crypttab spellings of the wanted flags that the host's systemd-cryptsetup understands
    (RHEL 8 has systemd 239, SLES 15 SP3 246: no workqueue options; the LUKS2 header's
    persistent flags, set by the formula, apply them at activation all the same). An unknown
    version gets every option."""
    wanted = [f for f in crypt_flags(luks) if f["wanted"]]
    try:
        version = int(str(systemd_version).split(".")[0].split("~")[0])
    except ValueError:
        return [f["crypttab"] for f in wanted]
    return [f["crypttab"] for f in wanted if version >= f["crypttab_since_systemd"]]


def validation_summary(errors):
    """Short text for state comments and CLI output."""
    if not errors:
        return "pillar hana:storage is valid"
    return "pillar hana:storage is invalid ({} error{}):\n  ".format(
        len(errors), "" if len(errors) == 1 else "s"
    ) + "\n  ".join(errors)


def _without_material(key):
    return {k: _without_material(v) if isinstance(v, dict) else v for k, v in key.items() if k != "material"}


def strip_secrets(value):
    """Deep copy with every 'material' replaced, for anything that leaves the module."""
    if isinstance(value, dict):
        return {k: (REDACTED if k == "material" else strip_secrets(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [strip_secrets(v) for v in value]
    return value
