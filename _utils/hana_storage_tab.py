"""/etc/crypttab, /etc/fstab and /proc/self/mountinfo: parsed and rendered. Pure code.

Field escapes follow util-linux and the kernel: a space in a path is ``\\040``, a tab ``\\011``,
a newline ``\\012``, a backslash ``\\134``.
"""

import re

_ESCAPE = re.compile(r"\\([0-7]{3})")


class TabError(ValueError):
    """A crypttab, fstab or mountinfo line that cannot be parsed."""


def unescape(field):
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def escape(field):
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in field)


def _fields(text, what):
    """Non-comment lines split into fields: [(line number, [fields])]."""
    if not isinstance(text, str):
        raise TabError(f"{what} must be text, got {type(text).__name__}")
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            yield number, stripped.split()


def parse_crypttab(text):
    """[{name, device, keyfile, options: [...], line}] from /etc/crypttab."""
    entries = []
    for number, fields in _fields(text, "crypttab"):
        if len(fields) < 2 or len(fields) > 4:
            raise TabError(f"crypttab line {number}: expected 2 to 4 fields, got {len(fields)}")
        keyfile = unescape(fields[2]) if len(fields) > 2 else "none"
        options = fields[3].split(",") if len(fields) > 3 else []
        entries.append(
            {
                "name": unescape(fields[0]),
                "device": unescape(fields[1]),
                "keyfile": keyfile,
                "options": [o for o in options if o],
                "line": number,
            }
        )
    return entries


def render_crypttab(name, device, keyfile, options):
    return f"{escape(name)} {escape(device)} {escape(keyfile or 'none')} {','.join(options) or 'none'}"


def parse_fstab(text):
    """[{spec, file, vfstype, options: [...], freq, passno, line}] from /etc/fstab."""
    entries = []
    for number, fields in _fields(text, "fstab"):
        if len(fields) < 3 or len(fields) > 6:
            raise TabError(f"fstab line {number}: expected 3 to 6 fields, got {len(fields)}")
        fields += ["defaults", "0", "0"][len(fields) - 3 :]
        for index in (4, 5):
            if not fields[index].isdigit():
                raise TabError(
                    f"fstab line {number}: field {index + 1} {fields[index][:20]!r} is not a number"
                )
        entries.append(
            {
                "spec": unescape(fields[0]),
                "file": unescape(fields[1]),
                "vfstype": fields[2],
                "options": fields[3].split(","),
                "freq": int(fields[4]),
                "passno": int(fields[5]),
                "line": number,
            }
        )
    return entries


def render_fstab(spec, file, vfstype, options, freq=0, passno=0):
    return f"{escape(spec)} {escape(file)} {vfstype} {','.join(options) or 'defaults'} {freq} {passno}"


def parse_mountinfo(text):
    """[{mount_id, parent_id, dev, root, mountpoint, options, fstype, source, super_options}]."""
    mounts = []
    for number, fields in _fields(text, "mountinfo"):
        try:
            separator = fields.index("-", 6)
        except ValueError:
            raise TabError(f"mountinfo line {number}: no '-' separator after the optional fields") from None
        if len(fields) < 10 or len(fields) - separator != 4:
            raise TabError(f"mountinfo line {number}: expected 10 or more fields, got {len(fields)}")
        if not (fields[0].isdigit() and fields[1].isdigit() and re.fullmatch(r"\d+:\d+", fields[2])):
            raise TabError(f"mountinfo line {number}: ids and major:minor malformed")
        mounts.append(
            {
                "mount_id": int(fields[0]),
                "parent_id": int(fields[1]),
                "dev": fields[2],
                "root": unescape(fields[3]),
                "mountpoint": unescape(fields[4]),
                "options": fields[5].split(","),
                "fstype": fields[separator + 1],
                "source": unescape(fields[separator + 2]),
                "super_options": fields[separator + 3].split(","),
            }
        )
    return mounts


def parse_blkid_export(text):
    """`blkid -p -o export <device>` -> {KEY: value} (TYPE, USAGE, PTTYPE, UUID, ...)."""
    if not isinstance(text, str):
        raise TabError(f"blkid output must be text, got {type(text).__name__}")
    values = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Z_]+", key):
            raise TabError(f"blkid line {number}: not KEY=value")
        values[key] = value
    return values
