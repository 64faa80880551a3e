"""`dmsetup table` output, parsed. Pure code, no I/O.

Every line is ``<name>: <start> <length> <target> <args...>``; a device with several segments
has several lines. crypt, striped and linear are parsed in full; other targets keep their
arguments. Key material is never kept: a crypt key (hex, a kernel keyring reference or ``-``)
becomes ``<redacted>`` plus its size, and any long hex run in another target's arguments
(dm-integrity's ``internal_hash:alg:key``, for one) is redacted too.
"""

import re

REDACTED = "<redacted>"
SECTOR = 512
CRYPT_FLAGS = (
    "allow_discards",
    "same_cpu_crypt",
    "submit_from_crypt_cpus",
    "no_read_workqueue",
    "no_write_workqueue",
    "high_priority",
    "iv_large_sectors",
)
# dmsetup mangles whitespace in device names (\x20): a name is one field. A target type has at
# most 16 characters (DM_MAX_TYPE_NAME, linux/dm-ioctl.h): a longer word there is no table line,
# and never passes through unredacted.
_LINE = re.compile(
    r"^(?P<name>\S+): (?P<start>\d+) (?P<length>\d+) (?P<target>[A-Za-z0-9_-]{1,16})(?: (?P<args>.*))?$"
)
_EMPTY = re.compile(r"^(?P<name>\S+):\s*$")
_DEVICE = re.compile(r"^(\d+:\d+|/dev/\S+)$")
_HEX_RUN = re.compile(r"[0-9a-fA-F]{32,}")
_CAPI = re.compile(r"^capi:(?P<mode>[a-z0-9_]+)\((?P<cipher>[a-z0-9_]+)\)-(?P<iv>.+)$")


class DmTableError(ValueError):
    """A `dmsetup table` line that cannot be parsed."""


def parse_tables(text):
    """{name: [segment, ...]} from the output of `dmsetup table` (all devices)."""
    if not isinstance(text, str):
        raise DmTableError(f"dmsetup table output must be text, got {type(text).__name__}")
    tables = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.strip() == "No devices found":
            continue
        empty = _EMPTY.match(line)
        if empty:
            tables.setdefault(empty["name"], [])
            continue
        match = _LINE.match(line)
        if not match:
            raise DmTableError(f"line {number}: not '<name>: <start> <length> <target> ...': {_clip(line)}")
        args = (match["args"] or "").split()
        try:
            segment = parse_segment(match["target"], args)
        except DmTableError as error:
            raise DmTableError(f"line {number} ({match['name']}): {error}") from None
        segment.update(start=int(match["start"]), length=int(match["length"]))
        tables.setdefault(match["name"], []).append(segment)
    return tables


def parse_segment(target, args):
    """One table segment's arguments -> dict (keys redacted)."""
    if target == "crypt":
        return _crypt(args)
    if target == "striped":
        return _striped(args)
    if target == "linear":
        if len(args) != 2:
            raise DmTableError(f"linear takes <device> <offset>, got {len(args)} arguments")
        return {"target": "linear", "device": _device(args[0]), "offset": _number(args[1], "offset")}
    return {"target": target, "args": [_HEX_RUN.sub(REDACTED, arg) for arg in args]}


def _crypt(args):
    if len(args) < 5:
        raise DmTableError(f"crypt takes at least 5 arguments, got {len(args)}")
    cipher_spec, key, iv_offset, device, offset = args[:5]
    segment = {
        "target": "crypt",
        "cipher": normalize_cipher(cipher_spec),
        "cipher_spec": cipher_spec,
        "key": REDACTED,
        **_key_facts(key),
        "iv_offset": _number(iv_offset, "iv_offset"),
        "device": _device(device),
        "offset": _number(offset, "offset"),
    }
    options = args[5:]
    if options:
        count = _number(options[0], "optional parameter count")
        if count != len(options) - 1:
            raise DmTableError(f"crypt says {count} optional parameters but has {len(options) - 1}")
        options = options[1:]
    flags, sector_size, integrity = [], SECTOR, None
    for option in options:
        name, _, value = option.partition(":")
        if option in CRYPT_FLAGS:
            flags.append(option)
        elif name == "sector_size":
            sector_size = _number(value, "sector_size")
            if sector_size not in (512, 1024, 2048, 4096):
                raise DmTableError(f"invalid sector_size {sector_size}")
        elif name == "integrity":
            integrity = value
        elif not re.fullmatch(r"[a-z_]+(:[A-Za-z0-9_():.-]+)*", option):
            raise DmTableError(f"unknown crypt option {_clip(option)}")
    segment.update(
        options=[_HEX_RUN.sub(REDACTED, o) for o in options],
        flags=sorted(flags),
        sector_size=sector_size,
        integrity=integrity,
    )
    return segment


def _key_facts(key):
    """Type and size of a crypt key, without the key."""
    if key == "-":
        return {"key_type": "none", "key_bits": 0}
    if key.startswith(":"):
        parts = key.split(":", 3)
        if len(parts) != 4 or not (parts[1].isascii() and parts[1].isdigit()):
            raise DmTableError("crypt key reference is not ':<size>:<type>:<description>'")
        return {"key_type": f"keyring-{parts[2]}", "key_bits": int(parts[1]) * 8}
    if re.fullmatch(r"[0-9a-fA-F]+", key):
        # dmsetup prints a masked key as zeros of the same length; a lone digit is an empty key
        return {"key_type": "hex", "key_bits": 0 if len(key) == 1 else len(key) * 4}
    raise DmTableError("crypt key is neither hex, a keyring reference nor '-'")


def _striped(args):
    if len(args) < 4:
        raise DmTableError(f"striped takes <count> <chunk> and device/offset pairs, got {len(args)}")
    count = _number(args[0], "stripe count")
    chunk = _number(args[1], "chunk size")
    pairs = args[2:]
    if count < 1 or len(pairs) != 2 * count:
        raise DmTableError(f"striped says {count} stripes but has {len(pairs) // 2} device/offset pairs")
    return {
        "target": "striped",
        "stripes": count,
        "chunk_sectors": chunk,
        "chunk_bytes": chunk * SECTOR,
        "devices": [
            {"device": _device(pairs[i]), "offset": _number(pairs[i + 1], "offset")}
            for i in range(0, len(pairs), 2)
        ],
    }


def normalize_cipher(spec):
    """'capi:xts(aes)-plain64' -> 'aes-xts-plain64'; dm-crypt's own spec stays as it is."""
    match = _CAPI.match(spec)
    if match:
        return f"{match['cipher']}-{match['mode']}-{match['iv']}"
    return spec


def _device(text):
    if not _DEVICE.match(text):
        raise DmTableError(f"device {_clip(text)} is neither <major>:<minor> nor a /dev path")
    return text


def _number(text, what):
    if not (text.isascii() and text.isdigit()) or len(text) > 20:
        raise DmTableError(f"{what} {_clip(text)} is not a number")
    return int(text)


def _clip(text, limit=60):
    text = _HEX_RUN.sub(REDACTED, text)
    return repr(text if len(text) <= limit else text[:limit] + "...")
