"""/etc/crypttab, /etc/fstab and /proc/self/mountinfo: parsed and rendered. Pure code.

Field escapes in fstab and mountinfo follow util-linux and the kernel: a space in a path is
``\\040``, a tab ``\\011``, a newline ``\\012``, a backslash ``\\134``. crypttab has none:
systemd-cryptsetup-generator takes its fields as they stand (``hana\\137data`` is a mapping of
that name), so they are read and written literally, and a field with whitespace cannot be written.

A mount point is known to systemd by its simplified path (``/hana/data/``, ``/hana//data`` and
``/hana/./data`` are one mount unit, and fstab-generator keeps the first entry of it):
``mount_key`` is that path, and fstab entries are matched by it.
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


def mount_key(path):
    """The mount point ``path`` as systemd names its mount unit: repeated slashes, ``.`` parts and
    a trailing slash gone (``..`` stays: systemd refuses such a mount point)."""
    if not path.startswith("/"):
        return path
    return "/" + "/".join(part for part in path.split("/") if part not in ("", "."))


def parse_crypttab(text):
    """[{name, device, keyfile, options: [...], line}] from /etc/crypttab (fields literal)."""
    entries = []
    for number, fields in _fields(text, "crypttab"):
        if len(fields) < 2 or len(fields) > 4:
            raise TabError(f"crypttab line {number}: expected 2 to 4 fields, got {len(fields)}")
        keyfile = fields[2] if len(fields) > 2 else "none"
        options = fields[3].split(",") if len(fields) > 3 else []
        entries.append(
            {
                "name": fields[0],
                "device": fields[1],
                "keyfile": keyfile,
                "options": [o for o in options if o],
                "line": number,
            }
        )
    return entries


def render_crypttab(name, device, keyfile, options):
    fields = [name, device, keyfile or "none", ",".join(options) or "none"]
    spaced = [f for f in fields if not f or any(c.isspace() for c in f)]
    if spaced:
        raise TabError(
            f"a crypttab field cannot be empty or hold whitespace (systemd reads none): {spaced[0]!r}"
        )
    return " ".join(fields)


def set_entry(text, kind, key, line):
    """(``text`` with the entry of ``key`` being ``line``, status): ``present`` when an entry of
    ``key`` reads as ``line`` already (spacing aside), ``change`` when one was rewritten, ``new``
    when ``line`` was appended. ``kind``: ``crypttab`` (``key`` is the mapping's name) or ``fstab``
    (``key`` is the mount point, matched as systemd does: ``mount_key``). Every other line is kept byte for byte, comments and lines that
    do not parse included; a second entry of ``key`` is dropped, as it could only contradict
    the first."""
    parse, field = {"crypttab": (parse_crypttab, "name"), "fstab": (parse_fstab, "file")}[kind]
    same_key = (lambda k: mount_key(k) == mount_key(key)) if kind == "fstab" else (lambda k: k == key)
    wanted = parse(line)[0]
    lines, found, same = text.splitlines(keepends=True), False, True
    result = []
    for raw in lines:
        try:
            entries = parse(raw)
        except TabError:
            entries = []  # not an entry: nobody's, kept
        if not entries or not same_key(entries[0][field]):
            result.append(raw)
            continue
        if found:
            same = False  # a repeated entry: dropped
            continue
        found = True
        if {k: v for k, v in entries[0].items() if k != "line"} == {
            k: v for k, v in wanted.items() if k != "line"
        }:
            result.append(raw)
        else:
            same = False
            result.append(line + "\n")
    if not found:
        if result and not result[-1].endswith("\n"):
            result[-1] += "\n"
        return "".join(result) + line + "\n", "new"
    return "".join(result), "present" if same else "change"


def drop_entry(text, kind, key):
    """``text`` without the entries of ``key`` (as set_entry matches them); every other line is
    kept byte for byte."""
    parse, field = {"crypttab": (parse_crypttab, "name"), "fstab": (parse_fstab, "file")}[kind]
    same_key = (lambda k: mount_key(k) == mount_key(key)) if kind == "fstab" else (lambda k: k == key)
    kept = []
    for raw in text.splitlines(keepends=True):
        try:
            entries = parse(raw)
        except TabError:
            entries = []
        if not entries or not same_key(entries[0][field]):
            kept.append(raw)
    return "".join(kept)


def parse_fstab(text):
    """[{spec, file, vfstype, options: [...], freq, passno, line}] from /etc/fstab."""
    entries = []
    for number, fields in _fields(text, "fstab"):
        if len(fields) < 3 or len(fields) > 6:
            raise TabError(f"fstab line {number}: expected 3 to 6 fields, got {len(fields)}")
        fields += ["defaults", "0", "0"][len(fields) - 3 :]
        for index in (4, 5):
            if not (fields[index].isascii() and fields[index].isdigit()):
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


def parse_mountinfo(text, malformed=None):
    """[{mount_id, parent_id, dev, root, mountpoint, options, fstype, source, super_options}].

    ``text`` is /proc/<pid>/mountinfo as text, or better as the bytes read from it: the kernel
    writes a path's bytes as they are (only space, tab, newline and backslash escaped), and one
    mount point that is not UTF-8 must not make the whole table unreadable. Such bytes come out
    as ``\\xff`` text: every UTF-8 path (a pillar's) compares exactly, and the result can be sent
    to the master (a lone surrogate could not).

    The format is proc(5)'s, read as such: one line per mount (ended by a newline only), fields
    separated by exactly one space - mount ID, parent ID, major:minor, root, mount point, mount
    options, zero or more optional fields (``shared:1`` ...), a ``-``, then filesystem type,
    source and super options. The source may be empty (``mount -t tmpfs "" /dir``: two spaces in
    a row) or ``-`` itself; whitespace is never collapsed.

    A line that breaks the format raises TabError naming it. With ``malformed`` (a list), it is
    appended there instead, as {"line": number, "error": message, "mountpoint": the line's mount
    point, or None when even that cannot be read (it may be any mount)}, and the other lines are
    returned: the caller decides whether what it looks for is known. A state must not guess.
    """
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", "backslashreplace")
    if not isinstance(text, str):
        raise TabError(f"mountinfo must be text, got {type(text).__name__}")
    mounts = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line:
            continue  # the end of the file (the kernel writes no empty line)
        fields = line.split(" ")
        try:
            mounts.append(_mountinfo_line(number, fields))
        except TabError as error:
            if malformed is None:
                raise
            malformed.append({"line": number, "error": str(error), "mountpoint": _mountpoint_of(fields)})
    return mounts


_MOUNT_HEAD = re.compile(r"\d+ \d+ \d+:\d+", re.ASCII)


def _mountinfo_line(number, fields):
    where = f"mountinfo line {number} ({' '.join(fields)[:120]!r})"
    try:
        separator = fields.index("-", 6)
    except ValueError:
        raise TabError(f"{where}: no '-' separator after the optional fields") from None
    if len(fields) < 10:
        raise TabError(f"{where}: expected 10 or more fields, got {len(fields)}")
    if not _MOUNT_HEAD.fullmatch(" ".join(fields[:3])):
        raise TabError(f"{where}: ids and major:minor malformed")
    if len(fields) - separator != 4:
        raise TabError(
            f"{where}: expected 3 fields after the '-' separator (type, source, super options), "
            f"got {len(fields) - separator - 1}"
        )
    empty = [i + 1 for i, f in enumerate(fields) if not f and i != separator + 2]
    if empty:
        raise TabError(f"{where}: field {empty[0]} is empty (only the source may be)")
    return {
        "mount_id": int(fields[0]),
        "parent_id": int(fields[1]),
        "dev": fields[2],
        "root": unescape(fields[3]),
        "mountpoint": unescape(fields[4]),
        "options": fields[5].split(","),
        "fstype": unescape(fields[separator + 1]),
        "source": unescape(fields[separator + 2]),
        "super_options": fields[separator + 3].split(","),
    }


def _mountpoint_of(fields):
    """The mount point of a malformed line, when its first five fields read as they should (ids,
    major:minor, an absolute path): the kernel escapes every space in a path, so they stand."""
    if len(fields) >= 5 and _MOUNT_HEAD.fullmatch(" ".join(fields[:3])) and fields[4].startswith("/"):
        return unescape(fields[4])
    return None


def mountinfo_doubt(malformed, path, holding=False):
    """The first line ``parse_mountinfo`` set aside that may matter for ``path``, or None.

    It may be the mount at ``path`` (its mount point is ``path``, or unreadable); with ``holding``,
    also a mount that holds ``path`` (a mount point above it). A caller that must know what is
    mounted there (a state about to mount, or to write a key to tmpfs) refuses on it, naming the
    line; any other malformed line does not concern it.
    """
    for entry in malformed:
        point = entry.get("mountpoint")
        if point is None or point == path:
            return entry
        if holding and path.startswith(point.rstrip("/") + "/"):
            return entry
    return None


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
