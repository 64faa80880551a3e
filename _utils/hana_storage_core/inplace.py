"""Encryption in place of a volume above LVM: where it stands, what comes next, the room its
LUKS2 header takes, and its progress. Pure code: the host module reads the facts, the state
runs the steps.

The route (LUKS2 "datashift", cryptsetup >= 2.2): the volume's LV is extended in its own stripes
by the header's room, since XFS cannot shrink; ``cryptsetup reencrypt --encrypt --init-only
--reduce-device-size <room>`` writes the header there and opens the device, whose first half
of the room becomes the data offset; the filesystem is mounted again from the crypt device
(HANA's only downtime); then ``cryptsetup reencrypt --resume-only`` encrypts online, in a
systemd unit of its own, so it outlives the Salt job and the minion. Datashift is the only
resilience cryptsetup offers for encryption with the header on the same device: every hotzone
is written to its new place before the header says it moved, so a kill or a power cut at any
moment leaves each block either where it was or where it goes, and the header says which.

A kill that is not SIGINT/SIGTERM may leave cryptsetup's hotzone and overlay devices in the
stack, one of them suspended: I/O freezes, and resuming that device by hand returns wrong data.
The only recovery is offline: unmount, close (removes the whole stack), open (libcryptsetup
recovers the hotzone at activation), mount, resume. The unit is stopped with SIGINT only.

Stages of a volume (``stage``), decided on facts from the host:

- ``plain``: the LV holds an XFS and no LUKS header: extend, unmount, copy its first bytes into
  the room (the copy cryptsetup makes too, but torn by a power cut in the middle of it, that one
  could not be told from a torn header write), initialise, remount, start.
- ``torn``: the state's own copy of the LV's first bytes into its room was complete (its LVM tag
  says so) and the head no longer matches it: cryptsetup's header write was cut off part-way.
  Refused, with the copy back named.
- ``unclear``: the room holds neither zeros, nor a copy of the head, and no tag says who wrote
  it: an init by an earlier version of the formula (which left the copy to cryptsetup) was cut
  off, in its copy (the head is intact) or in its header write (the tail is the only copy).
  Refused, with how to tell the two apart.
- ``blank``: nothing on it (a new host): nothing to encrypt; the LUKS states format it.
- ``running``: a re-encryption of the volume runs (the unit is active).
- ``paused``: the header says a re-encryption is under way, the device is open and its stack
  clean, nothing runs it: start the unit (after a clean stop, or a reboot: the boot's open
  recovered the hotzone).
- ``closed``: under way, but not open: open (recovery), mount, start.
- ``crashed``: under way, open, nothing runs it and cryptsetup's hotzone or overlay devices
  are still in the stack, none suspended: the offline recovery above, then start.
- ``frozen``: as ``crashed``, but a device of the stack is suspended: I/O to the volume hangs,
  and an unmount would hang with it. Only a reboot recovers it (the boot's open recovers the
  hotzone, as after a power cut); nothing is touched.
- ``done``: LUKS2 without a re-encryption: nothing left for this route.
- ``foreign``: anything else on the LV: refused.
"""

import datetime
import json
import math

from . import commands

MIB = 1 << 20
# The room a LUKS2 header takes in front of the data when encrypting in place: cryptsetup's
# default data offset (16 MiB) is half of what --reduce-device-size takes from the device.
HEADER_ROOM = 32 * MIB
MAX_ROOM = 1 << 30  # cryptsetup refuses a larger --reduce-device-size
UNIT_PREFIX = "hana-storage-encrypt-"


class InPlaceError(ValueError):
    """A progress line or a fact that cannot be what cryptsetup or the host says."""


def unit_name(crypt_name):
    """The systemd unit that runs the re-encryption of ``crypt_name``."""
    return f"{UNIT_PREFIX}{crypt_name}.service"


def header_room(stripes, stripe_bytes, extent_bytes):
    """Bytes the LV grows by and --reduce-device-size takes: at least HEADER_ROOM, whole
    extents in every stripe (so the LV grows in its own geometry), and twice a full stripe width
    (the data offset, half of it, then starts the payload on a full stripe, as XFS's su/sw
    expect). Raises InPlaceError beyond what cryptsetup accepts."""
    if stripes < 1 or extent_bytes < 1 or stripe_bytes < 0:
        raise InPlaceError(f"no geometry: {stripes} stripes of {stripe_bytes} bytes, extent {extent_bytes}")
    width = max(stripe_bytes, 1) * stripes
    unit = math.lcm(2 * width, stripes * extent_bytes, MIB)
    room = -(-HEADER_ROOM // unit) * unit
    if room > MAX_ROOM:
        raise InPlaceError(
            f"the header's room in {stripes} stripes of {stripe_bytes} bytes with {extent_bytes}-byte "
            f"extents would be {room} bytes, more than cryptsetup takes ({MAX_ROOM})"
        )
    return room


# The LVM tag that records the LV's size before its extension for the header: every byte of
# the LV as it was is the volume's (unknown is not blank: not only the XFS's), so the LV grows
# by the whole room once, and a run killed after the lvextend must not grow it again.
PLAIN_TAG = "hana_storage_plain_bytes_"


def plain_tag(plain_bytes):
    return f"{PLAIN_TAG}{plain_bytes}"


# the day the route made the volume key: cryptsetup refuses a token on the header from the init
# to the end, so the date token (reencrypt.KEY_DATE_TOKEN) is written once the encryption ends,
# with this day (written with PLAIN_TAG, before the init: a later init only makes it older)
KEY_DAY_TAG = "hana_storage_key_made_"


# The state's own copy of the LV's first ``data_shift`` bytes into the end of its room, made
# with the filesystem unmounted before cryptsetup runs: BEGUN (set before the unmount, kept until
# the init ended) says cryptsetup runs on this LV only after COPIED, so without COPIED the head is
# as it was whatever the tail holds; COPIED (set once the copy reads back equal, dropped before
# any mount of the XFS from the LV) says the tail is the head as it was unmounted, so a head that
# differs was changed by the header write. Both go once the init ended.
HEAD_COPY_BEGUN_TAG = "hana_storage_head_copy_begun"
HEAD_COPIED_TAG = "hana_storage_head_copied"
HEAD_COPY_TAGS = (HEAD_COPY_BEGUN_TAG, HEAD_COPIED_TAG)


def head_copy(tags):
    """How far the state's copy of the head got, by an LV's tags: "copied", "begun" or None."""
    if HEAD_COPIED_TAG in tags:
        return "copied"
    return "begun" if HEAD_COPY_BEGUN_TAG in tags else None


def key_day_tag(day):
    return f"{KEY_DAY_TAG}{day.isoformat()}"


def tagged_key_day(tags):
    """The day (ISO) a KEY_DAY_TAG among an LV's ``tags`` records (the oldest, if several), or None."""
    days = []
    for tag in tags:
        text = tag[len(KEY_DAY_TAG) :] if tag.startswith(KEY_DAY_TAG) else ""
        if len(text) == 10 and text.isascii():
            try:
                days.append(datetime.date.fromisoformat(text))
            except ValueError:
                continue
    return min(days).isoformat() if days else None


def room_plan(device_bytes, fs_bytes, tags, room):
    """(plain bytes, bytes the LV must still grow): the LV's size before the extension (its tag,
    else its size now) and what it lacks for ``room`` beyond it. Raises InPlaceError when the
    filesystem does not fit the plain size (it would be cut)."""
    recorded = [t[len(PLAIN_TAG) :] for t in tags if t.startswith(PLAIN_TAG)]
    if len(recorded) > 1 or (recorded and not (recorded[0].isascii() and recorded[0].isdigit())):
        raise InPlaceError(
            f"the LV's tags {', '.join(sorted(tags))} do not say one size before the extension"
        )
    plain = int(recorded[0]) if recorded else device_bytes
    if plain > device_bytes:
        raise InPlaceError(f"the LV is {device_bytes} bytes, less than the {plain} its tag says it held")
    if fs_bytes > plain:
        raise InPlaceError(f"its XFS ({fs_bytes} bytes) is larger than the volume ({plain} bytes)")
    return plain, max(plain + room - device_bytes, 0)


def data_shift(room):
    """The bytes --init-only moves from the head to the device's end: half the room."""
    return room // 2


# what a cut write leaves whole: a sector of a copy is all there or not at all (512e and 512n
# LUNs persist 512 bytes at a time)
COPY_BLOCK = 512


def tail_state(head, tail):
    """What the last ``data_shift`` bytes of a tagged LV hold against its first: "zero" (as the
    extension left them), "copy" (of the LV's first bytes), "partial" (each sector either the
    head's or zeros: a copy cut off part-way, the head as it was) or "other" (sectors where the
    head differs from data in the tail: the head changed after a copy, by a header write or a
    mounted XFS)."""
    if not tail.strip(b"\0"):
        return "zero"
    if head == tail:
        return "copy"
    for at in range(0, len(tail), COPY_BLOCK):
        block = tail[at : at + COPY_BLOCK]
        if block != head[at : at + COPY_BLOCK] and block.strip(b"\0"):
            return "other"
    return "partial"


def sector_size(wanted, fs_sector):
    """The LUKS2 sector size encryption in place can give: the pillar's, unless the filesystem's
    sectors are smaller (cryptsetup refuses larger encryption sectors than the filesystem's;
    such a volume keeps its 4 KiB finding until its filesystem is made anew)."""
    return min(wanted, fs_sector) if fs_sector else wanted


def stage(facts):
    """(stage, why) of a volume from its facts:

    {"signature": "xfs" | "crypto_LUKS" | other | "", "reencryption": header fact or None,
    "tail": "zero" | "copy" | "partial" | "other" | None (see tail_state; None: the LV was not
    grown for the header), "head_copy": "copied" | "begun" | None (head_copy),
    "mapped": the crypt mapping exists, "running": the unit is active,
    "leftovers": [cryptsetup's hotzone/overlay devices of the mapping],
    "suspended": [the mapping and those of its leftovers that are suspended]}.
    """
    signature, underway = facts["signature"], facts.get("reencryption")
    if signature != "crypto_LUKS" and facts.get("running"):
        return "foreign", (
            "is being changed by a cryptsetup reencrypt the formula did not start: let it end, or stop it"
        )
    if signature == "xfs" and facts.get("mapped"):
        return "foreign", "holds an unencrypted XFS, and its crypt name is taken by another mapping"
    if signature in ("xfs", "") and facts.get("tail") is not None:
        cut = _cut_init(facts)
        if cut:
            return cut
    if signature == "xfs":
        return "plain", "holds an unencrypted XFS"
    if not signature:
        return (
            "blank",
            "holds no filesystem: nothing to encrypt in place (luks-N formats it, if its guard allows)",
        )
    if signature != "crypto_LUKS":
        return "foreign", f"holds {signature or 'no known signature'}, not an XFS to encrypt"
    if not underway:
        return "done", "is LUKS2 with no re-encryption under way"
    if underway.get("mode") != "encrypt":
        return "foreign", (
            f"is under a re-encryption (mode {underway.get('mode')}) the formula did not start: finish it "
            "with cryptsetup reencrypt --resume-only"
        )
    if facts.get("running"):
        return "running", "is being encrypted"
    if not facts.get("mapped"):
        return "closed", "is being encrypted, but not open and nothing runs the encryption"
    if facts.get("leftovers") and facts.get("suspended"):
        return "frozen", (
            f"was being encrypted when cryptsetup was killed, and {', '.join(facts['suspended'])} of its "
            "stack stayed suspended: I/O to it hangs"
        )
    if facts.get("leftovers"):
        return "crashed", (
            f"was being encrypted when cryptsetup was killed: {', '.join(facts['leftovers'])} "
            "still in its stack"
        )
    return "paused", "is being encrypted, open, and nothing runs the encryption"


def _cut_init(facts):
    """(stage, why) of an LV grown for the header that holds no LUKS header, when an init was cut
    off on it; None when its head is as it was (cryptsetup has not written it: "plain" goes on)."""
    copy, tail = facts.get("head_copy"), facts["tail"]
    # also when the XFS was mounted from the LV since (a boot through fstab) and changed its
    # head: no fact tells that from a torn header write, so the admin is asked (the refusal)
    if copy == "copied" and tail != "copy":
        return "torn", (
            "holds no LUKS2 header, and its first bytes no longer match the copy the formula made of "
            "them in its room: cryptsetup reencrypt --init-only was cut off while writing the header"
        )
    if copy is None and tail in ("partial", "other"):
        half = (
            "copying them there" if tail == "partial" else "writing the header (or the XFS was mounted since)"
        )
        return "unclear", (
            "holds no LUKS2 header, and its room neither zeros nor a copy of its first bytes, and no tag "
            f"of the formula's own copy: an init by an earlier version of the formula was cut off while {half}"
        )
    if not facts["signature"]:
        return "foreign", "holds neither an XFS nor a LUKS2 header, though the formula grew it for one"
    return None


def reencryption_stack(crypt_name):
    """The devices cryptsetup puts under the mapping ``crypt_name`` while it re-encrypts it
    online (lib/luks2/luks2_reencrypt.c): ``<name>-hotzone-forward|backward``, ``<name>-overlay``.
    They hold the device the mapping is on meanwhile."""
    return frozenset(f"{crypt_name}-{part}" for part in ("overlay", "hotzone-forward", "hotzone-backward"))


def leftovers(crypt_name, dm_names):
    """The devices of ``crypt_name``'s re-encryption stack among ``dm_names``: while it runs, or
    what a killed run left."""
    return sorted(set(dm_names) & reencryption_stack(crypt_name))


def parse_progress(line):
    """One line of ``cryptsetup reencrypt --progress-json``: {"done", "size", "percent",
    "eta_s", "bytes_per_s"}."""
    if len(line) > 4096:
        raise InPlaceError(f"not a progress line: {len(line)} characters")
    try:
        data = json.loads(line)
    except (ValueError, RecursionError) as error:
        raise InPlaceError(f"not a progress line: {error}") from None
    if not isinstance(data, dict):
        raise InPlaceError("not a progress line: not a JSON object")
    numbers = {}
    for key in ("device_bytes", "device_size", "speed", "eta_ms"):
        value = data.get(key)
        if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 20:
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 64:
            raise InPlaceError(f"progress line: {key} is {value!r}, not a count")
        numbers[key] = value
    if not numbers["device_size"] or numbers["device_bytes"] > numbers["device_size"]:
        raise InPlaceError(f"progress line: {numbers['device_bytes']} of {numbers['device_size']} bytes")
    return {
        "done": numbers["device_bytes"],
        "size": numbers["device_size"],
        "percent": int(100 * numbers["device_bytes"] // numbers["device_size"]),
        "eta_s": numbers["eta_ms"] // 1000,
        "bytes_per_s": numbers["speed"],
    }


def last_progress(text):
    """The last well-formed progress line of a unit's output, or None."""
    for line in reversed((text or "").splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return parse_progress(line)
            except InPlaceError:
                continue
    return None


def describe(crypt_name, progress):
    """ "encrypting hana_data: 37 %, about 2 h 10 min left"."""
    if not progress:
        return f"encrypting {crypt_name}: started, no progress reported yet"
    left = progress["eta_s"]
    hours, minutes = divmod(-(-left // 60), 60)
    when = f"{hours} h {minutes} min" if hours else f"{max(minutes, 1)} min"
    return f"encrypting {crypt_name}: {progress['percent']} %, about {when} left"


def holders_text(processes):
    """[{"pid", "comm"}] -> "hdbindexserver (pid 4242), bash (pid 17)"."""
    return ", ".join(f"{p['comm']} (pid {p['pid']})" for p in sorted(processes, key=lambda p: p["pid"]))


def reencrypt_init(device, crypt_name, key_file, luks, room, sector):
    """``cryptsetup reencrypt --encrypt --init-only``: the header in the room at the device's
    end, the device opened as ``crypt_name``. The key is named by its file only."""
    return [
        "cryptsetup",
        "reencrypt",
        "--batch-mode",
        "--encrypt",
        "--init-only",
        "--type",
        "luks2",
        "--cipher",
        luks["cipher"],
        "--key-size",
        str(luks["key_size"]),
        "--sector-size",
        str(sector),
        "--luks2-metadata-size",
        commands.LUKS2_METADATA_SIZE,
        *commands.pbkdf_args(luks.get("pbkdf", {})),
        "--reduce-device-size",
        f"{room // MIB}M",
        "--key-file",
        key_file,
        "--label",
        crypt_name,
        device,
        crypt_name,
    ]


def reencrypt_unit(
    crypt_name, key_file, device, max_mib_s=None, what="encrypt {} in place", hotzone_mib=None
):
    """``systemd-run`` of the online re-encryption: a unit that survives the Salt job and the
    minion, stopped with SIGINT only (cryptsetup then finishes its hotzone and records where it
    is; SIGKILL would leave the stack frozen, see above), never killed on a timeout. With
    ``max_mib_s`` its reads and writes of ``device`` (the LV it encrypts) are capped; with
    ``hotzone_mib`` no hotzone is larger (not with datashift: its hotzone is the shift)."""
    limits = (
        [
            f"--property=IOReadBandwidthMax={device} {max_mib_s}M",
            f"--property=IOWriteBandwidthMax={device} {max_mib_s}M",
        ]
        if max_mib_s
        else []
    )
    return [
        "systemd-run",
        f"--unit={unit_name(crypt_name)}",
        f"--description=hana-storage: {what.format(crypt_name)}",
        "--property=KillSignal=SIGINT",
        "--property=SendSIGKILL=no",
        "--property=TimeoutStopSec=infinity",
        *limits,
        "cryptsetup",
        "reencrypt",
        "--resume-only",
        "--batch-mode",
        "--key-file",
        key_file,
        "--progress-json",
        "--progress-frequency",
        "10",
        *(["--hotzone-size", f"{hotzone_mib}M"] if hotzone_mib else []),
        "--active-name",
        crypt_name,
    ]
