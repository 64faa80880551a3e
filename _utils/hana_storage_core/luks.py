"""LUKS1 and LUKS2 on-disk headers, parsed natively. Pure code: bytes come from a ``read`` callable.

``parse_header(read)`` where ``read(offset, size) -> bytes`` (fewer bytes at the end of a device).
LUKS2 (https://gitlab.com/cryptsetup/LUKS2-docs): a 4096-byte binary header followed by a JSON
area, the whole ``hdr_size`` checksummed (csum field zeroed); a second copy follows at
``hdr_size``. Both copies are read and verified; when one is damaged the other is used and the
result says ``degraded``. LUKS1: one 592-byte header, no checksum.

The summary carries no salts, digests or key material: only what an audit needs. Its
``fingerprint`` (a SHA-256 of the LUKS2 JSON metadata, or of the whole LUKS1 header) is the same
for a header and its ``luksHeaderBackup`` until a keyslot, token or segment changes.
"""

import base64
import binascii
import hashlib
import json
import re
import struct

from . import reencrypt, tpm

MAGIC_PRIMARY = b"LUKS\xba\xbe"
MAGIC_SECONDARY = b"SKUL\xba\xbe"
BINARY_HEADER_SIZE = 4096
# Where a LUKS2 secondary header may sit: every allowed hdr_size (16 KiB .. 4 MiB).
LUKS2_HEADER_SIZES = tuple(16384 << i for i in range(9))
LUKS1_HEADER_SIZE = 592
# The most a LUKS2 header takes: two 4 MiB metadata copies and cryptsetup's 128 MiB keyslots area.
MAX_HEADER_BYTES = 2 * (4 << 20) + (128 << 20)
LUKS1_KEYSLOT_ACTIVE = 0x00AC71F3
LUKS1_KEYSLOT_DISABLED = 0x0000DEAD
LUKS2_FLAGS = (
    "allow-discards",
    "same-cpu-crypt",
    "submit-from-crypt-cpus",
    "no-journal",
    "no-read-workqueue",
    "no-write-workqueue",
    "high-priority",
)


class LuksError(ValueError):
    """Not a LUKS header, or one too damaged to read."""

    def __init__(self, message, no_magic=False):
        super().__init__(message)
        self.no_magic = no_magic


def is_luks(first_bytes):
    """True when the bytes start with a LUKS1/LUKS2 magic (either copy's)."""
    return first_bytes[:6] in (MAGIC_PRIMARY, MAGIC_SECONDARY)


def claimed_uuid(first_bytes):
    """The UUID a LUKS2 primary binary header names, read without its checksum, or None. A
    header cut short as it is written (luksFormat killed between the binary header and its JSON
    area: no copy is readable) still names the UUID the formula gave it (``luksFormat --uuid``)."""
    if len(first_bytes) < BINARY_HEADER_SIZE or first_bytes[:6] != MAGIC_PRIMARY or _u16(first_bytes, 6) != 2:
        return None
    try:
        return _text(first_bytes[168:208], "uuid") or None
    except LuksError:
        return None


def torn_format_uuid(read):
    """The UUID of a LUKS2 header a luksFormat was killed while writing (``claimed_uuid``), or
    None for any other header. cryptsetup zeroes the header areas, then writes the primary copy
    (binary header without its checksum, JSON area, binary header with it) and only then the
    secondary copy: cut short, it leaves a primary that does not verify and a secondary area
    that still reads all zero. A header whose primary verifies (unreadable for another reason:
    an I/O error, metadata this parser rejects) or whose secondary area was written (a header
    once whole and damaged since, restorable from a backup) is not one."""
    start = read(0, BINARY_HEADER_SIZE)
    uuid = claimed_uuid(start)
    if uuid is None:
        return None
    size = struct.unpack_from(">Q", start, 8)[0]
    if size not in LUKS2_HEADER_SIZES:
        return None
    try:
        _read_luks2_copy(read, 0, MAGIC_PRIMARY, start)
    except LuksError:
        pass
    else:
        return None
    secondary = read(size, size)
    if len(secondary) != size or secondary.count(0) != size:
        return None
    return uuid


def parse_header(read):
    """Summary of the LUKS header of a device, or LuksError."""
    start = read(0, BINARY_HEADER_SIZE)
    if len(start) >= 8 and start[:6] == MAGIC_PRIMARY and _u16(start, 6) == 1:
        return _parse_luks1(start)
    return _parse_luks2(read, start)


def header_bytes(header):
    """How many bytes from the start of the device hold the LUKS ``header`` (parse_header's): what
    an in-memory copy of it must hold to be opened or backed up. None when the header does not
    say, or says more than a LUKS header can take (the data offset may lie far beyond it)."""
    size = header.get("header_size")
    offset = header.get("data_offset")
    if isinstance(size, int) and isinstance(offset, int) and 0 < offset < size:
        size = offset  # the data starts inside what the keyslots area may take: the header ends there
    if not isinstance(size, int) or not 0 < size <= MAX_HEADER_BYTES:
        return None
    return size


# ---- LUKS1 ---------------------------------------------------------------------------------


def _parse_luks1(raw):
    if len(raw) < LUKS1_HEADER_SIZE:
        raise LuksError(f"LUKS1 header truncated: {len(raw)} of {LUKS1_HEADER_SIZE} bytes")
    cipher_name = _text(raw[8:40], "cipher name")
    cipher_mode = _text(raw[40:72], "cipher mode")
    hash_spec = _text(raw[72:104], "hash spec")
    payload_offset, key_bytes = struct.unpack_from(">II", raw, 104)
    uuid = _text(raw[168:208], "uuid")
    if not cipher_name or key_bytes == 0 or key_bytes > 512:
        raise LuksError(f"LUKS1 header invalid: cipher {cipher_name!r}, key bytes {key_bytes}")
    keyslots = []
    header_size = LUKS1_HEADER_SIZE
    for slot in range(8):
        active, iterations = struct.unpack_from(">II", raw, 208 + slot * 48)
        material, stripes = struct.unpack_from(">II", raw, 208 + slot * 48 + 40)
        header_size = max(header_size, material * 512 + -(-key_bytes * stripes // 512) * 512)
        if active == LUKS1_KEYSLOT_ACTIVE:
            kdf = {"type": "pbkdf2", "hash": hash_spec, "iterations": iterations}
            fingerprint = hashlib.sha256(raw[208 + slot * 48 : 256 + slot * 48]).hexdigest()[:16]
            keyslots.append(
                {"id": slot, "type": "luks1", "key_size": key_bytes * 8, "kdf": kdf, "volume_key": "0",
                 "fingerprint": fingerprint}
            )  # fmt: skip
        elif active != LUKS1_KEYSLOT_DISABLED:
            raise LuksError(f"LUKS1 keyslot {slot} has an invalid state 0x{active:08x}")
    cipher = f"{cipher_name}-{cipher_mode}" if cipher_mode else cipher_name
    return {
        "version": 1,
        "uuid": uuid,
        "label": "",
        "subsystem": "",
        "cipher": cipher,
        "key_size": key_bytes * 8,
        "sector_size": 512,
        "data_offset": payload_offset * 512,
        "header_size": header_size,  # the end of the last keyslot's key material
        "keyslots": keyslots,
        "segments": [{"id": 0, "type": "crypt", "encryption": cipher, "sector_size": 512}],
        "flags": [],
        "requirements": [],
        "tokens": [],
        "reencryption": None,
        "hash": hash_spec,
        "fingerprint": hashlib.sha256(raw[:LUKS1_HEADER_SIZE]).hexdigest(),
        "degraded": False,
        "copies": {"primary": "ok"},
    }


# ---- LUKS2 ---------------------------------------------------------------------------------


def _parse_luks2(read, start):
    copies, errors = {}, []
    primary = secondary = None
    try:
        primary = _read_luks2_copy(read, 0, MAGIC_PRIMARY, start)
        copies["primary"] = "ok"
    except LuksError as error:
        copies["primary"] = str(error)
        errors.append(error)
    # The secondary sits at the primary's hdr_size; with the primary gone, probe every allowed size.
    offsets = [primary["hdr_size"]] if primary else list(LUKS2_HEADER_SIZES)
    secondary_errors = []
    for offset in offsets:
        try:
            secondary = _read_luks2_copy(read, offset, MAGIC_SECONDARY)
            copies["secondary"] = "ok"
            break
        except LuksError as error:
            secondary_errors.append(error)
    errors += secondary_errors
    if secondary is None:
        # the most telling reason: a copy whose magic was there but that failed a later check
        damaged = [e for e in secondary_errors if not e.no_magic]
        if damaged or len(offsets) == 1:
            copies["secondary"] = str((damaged or secondary_errors)[0])
        else:
            copies["secondary"] = "not found at any allowed offset"
    if primary is None and secondary is None:
        if all(e.no_magic for e in errors):
            raise LuksError("no LUKS header (no LUKS magic at offset 0 and no LUKS2 secondary header)")
        raise LuksError(
            f"no readable LUKS2 header copy: primary: {copies['primary']}; secondary: {copies['secondary']}"
        )
    degraded = primary is None or secondary is None
    if primary and secondary and primary["seqid"] != secondary["seqid"]:
        copies["secondary"] = f"seqid {secondary['seqid']} differs from the primary's {primary['seqid']}"
        degraded = True
    best = max((c for c in (primary, secondary) if c), key=lambda c: c["seqid"])
    summary = _summarise(best)
    summary.update(
        degraded=degraded,
        copies=copies,
        seqid=best["seqid"],
        hdr_size=best["hdr_size"],
        fingerprint=hashlib.sha256(
            json.dumps(best["metadata"], sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest(),
    )
    return summary


def _read_luks2_copy(read, offset, magic, raw=None):
    raw = raw if raw is not None else read(offset, BINARY_HEADER_SIZE)
    if len(raw) < BINARY_HEADER_SIZE:
        raise LuksError(f"header at {offset} truncated ({len(raw)} bytes)", no_magic=True)
    if raw[:6] != magic:
        which = "primary" if offset == 0 else "secondary"
        raise LuksError(f"no LUKS2 {which} magic at offset {offset}", no_magic=True)
    version = _u16(raw, 6)
    if version != 2:
        raise LuksError(f"header at {offset}: version {version}, expected 2")
    hdr_size, seqid = struct.unpack_from(">QQ", raw, 8)
    if hdr_size not in LUKS2_HEADER_SIZES:
        raise LuksError(f"header at {offset}: invalid hdr_size {hdr_size}")
    hdr_offset = struct.unpack_from(">Q", raw, 256)[0]
    if hdr_offset != offset:
        raise LuksError(f"header at {offset} says it is at {hdr_offset}")
    algorithm = _text(raw[72:104], "checksum algorithm")
    if algorithm not in ("sha256", "sha512", "sha1"):
        raise LuksError(f"header at {offset}: unsupported checksum algorithm {algorithm!r}")
    area = raw + read(offset + BINARY_HEADER_SIZE, hdr_size - BINARY_HEADER_SIZE)
    if len(area) < hdr_size:
        raise LuksError(f"header at {offset} truncated: {len(area)} of {hdr_size} bytes")
    digest = hashlib.new(algorithm)
    digest.update(area[:448])
    digest.update(bytes(64))
    digest.update(area[512:hdr_size])
    stored = raw[448 : 448 + digest.digest_size]
    if digest.digest() != stored:
        raise LuksError(f"header at {offset}: {algorithm} checksum mismatch")
    metadata = _json_area(area[BINARY_HEADER_SIZE:hdr_size], offset)
    return {
        "seqid": seqid,
        "hdr_size": hdr_size,
        "label": _text(raw[24:72], "label"),
        "subsystem": _text(raw[208:256], "subsystem"),
        "uuid": _text(raw[168:208], "uuid"),
        "checksum_alg": algorithm,
        "metadata": metadata,
    }


def _json_area(area, offset):
    text = area.split(b"\0", 1)[0]
    try:
        metadata = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise LuksError(f"header at {offset}: JSON metadata unreadable ({error})") from None
    if not isinstance(metadata, dict):
        raise LuksError(f"header at {offset}: JSON metadata is not an object")
    for key in ("keyslots", "segments", "digests", "config"):
        if not isinstance(metadata.get(key), dict):
            raise LuksError(f"header at {offset}: JSON metadata lacks the {key!r} object")
    return metadata


def _summarise(copy):
    meta = copy["metadata"]
    segments = [_segment(sid, seg) for sid, seg in _numbered(meta["segments"], "segment")]
    volume_key_of = _volume_keys(meta["digests"])
    keyslots = []
    for kid, slot in _numbered(meta["keyslots"], "keyslot"):
        summary = _keyslot(kid, slot)
        summary["volume_key"] = volume_key_of.get(str(kid)) if summary["kdf"] is not None else None
        keyslots.append(summary)
    tokens = []
    for tid, tok in _numbered(meta.get("tokens") or {}, "token"):
        token = {
            "id": tid,
            "type": _field(tok, "type", str, f"token {tid}"),
            "keyslots": tok.get("keyslots", []),
        }
        if token["type"] == "clevis":
            token["clevis"] = clevis_binding(tok)
        elif token["type"] == tpm.PCR_TOKEN:
            token["pcrs"] = tpm.pcr_record(tok)
        elif token["type"] == reencrypt.KEY_DATE_TOKEN:
            token["key_date"] = reencrypt.token_date(tok)
        tokens.append(token)
    config = meta["config"]
    flags = config.get("flags", [])
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        raise LuksError("config.flags is not a list of strings")
    requirements = (
        config.get("requirements", {}).get("mandatory", [])
        if isinstance(config.get("requirements"), dict)
        else []
    )
    crypt = [s for s in segments if s["type"] == "crypt"]
    first = crypt[0] if crypt else (segments[0] if segments else {})
    # _volume_keys checked every digest: an object whose keyslots and segments are lists of ids
    slot_ids = {k for d in meta["digests"].values() if "0" in d["segments"] for k in d["keyslots"]}
    key_slots = [s for s in keyslots if s["type"] != "reencrypt"]  # a reencrypt keyslot holds no key
    sized = [s["key_size"] for s in key_slots if str(s["id"]) in slot_ids] or [
        s["key_size"] for s in key_slots
    ]
    requirements = list(requirements) if isinstance(requirements, list) else []
    keyslots_size = config.get("keyslots_size")
    keyslots_size = (
        int(keyslots_size)
        if isinstance(keyslots_size, str) and keyslots_size.isascii() and keyslots_size.isdigit()
        else None
    )
    return {
        "version": 2,
        # the bytes the header takes (both metadata copies, the keyslots area): what a backup holds
        "header_size": 2 * copy["hdr_size"] + keyslots_size if keyslots_size is not None else None,
        "uuid": copy["uuid"],
        "label": copy["label"],
        "subsystem": copy["subsystem"],
        "checksum_alg": copy["checksum_alg"],
        "cipher": first.get("encryption"),
        "key_size": max(sized) if sized else None,
        "sector_size": first.get("sector_size"),
        "data_offset": first.get("offset"),
        "keyslots": keyslots,
        "segments": segments,
        "flags": sorted(flags),
        "requirements": requirements,
        "tokens": tokens,
        "reencryption": _reencryption(keyslots, requirements, meta["segments"]),
        # which volume keys encrypt the data (two during a re-encryption), by fingerprint only
        "volume_keys": _keys_in_use(meta["digests"]),
    }


def clevis_binding(token):
    """What a Clevis token binds to, from its JWE's protected header (never its ciphertext nor
    a TPM2's sealed objects): ``{"pin", "threshold", "servers": [{"url", "thumbprints", "kid"}],
    "tpm2": {"pcr_bank", "pcr_ids"} or None}``, or ``{"error"}``. ``threshold`` and ``servers``
    are the Tang part's (0 and [] without Tang); ``tpm2`` the TPM2 share's.

    The policies read are those the formula makes (commands.clevis_config): one tang or tpm2
    pin; sss over tang pins; sss needing both a tpm2 share and a Tang part (a tang pin or an sss
    over tang pins). Any other is an error: a binding the formula cannot compare.

    A server's ``thumbprints`` are the RFC 7638 thumbprints (SHA-256 and SHA-1, base64url) of
    the signing keys its advertisement had at binding time; ``kid`` is the exchange key's.
    """
    try:
        header = _protected_header(token["jwe"]["protected"])
        pin = header["clevis"]["pin"]
        tang, tpm2 = _clevis_policy(header)
        if tpm2 is None and tang is None:
            raise ValueError("no pin")
        return {
            "pin": pin,
            "threshold": tang["threshold"] if tang else 0,
            "servers": tang["servers"] if tang else [],
            "tpm2": tpm2,
        }
    except ClevisPolicyError as error:
        return {"error": str(error)}
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as error:
        return {"error": f"unreadable Clevis token: {type(error).__name__}: {error}"}


class ClevisPolicyError(ValueError):
    """A Clevis binding of a shape the formula does not make."""


MAX_SSS_DEPTH = 2  # the formula nests one sss (of Tang pins) inside another (with the TPM2's)


def _clevis_policy(header, depth=0):
    """(Tang part {"threshold", "servers"} or None, TPM2 part or None) of one pin's header."""
    if depth > MAX_SSS_DEPTH:
        raise ClevisPolicyError("sss policies nested deeper than the formula makes them")
    clevis = header["clevis"]
    pin = clevis["pin"]
    if pin == "tang":
        return {"threshold": 1, "servers": [_tang_server(clevis["tang"], header)]}, None
    if pin == "tpm2":
        return None, _tpm2_policy(clevis["tpm2"])
    if pin != "sss":
        raise ClevisPolicyError(f"pin {pin!r} is not tang, tpm2 or sss")
    threshold = int(clevis["sss"]["t"])
    shares = [
        _clevis_policy(_protected_header(compact.split(".")[0]), depth + 1)
        for compact in clevis["sss"]["jwe"]
    ]
    if all(tang and not tpm2 and tang["threshold"] == 1 for tang, tpm2 in shares):
        return {"threshold": threshold, "servers": [s for tang, _ in shares for s in tang["servers"]]}, None
    tpm2_shares = [tpm2 for tang, tpm2 in shares if tpm2 and not tang]
    tang_shares = [tang for tang, tpm2 in shares if tang and not tpm2]
    if len(shares) == 2 and threshold == 2 and len(tpm2_shares) == 1 and len(tang_shares) == 1:
        return tang_shares[0], tpm2_shares[0]
    raise ClevisPolicyError(
        f"an sss policy (threshold {threshold} of {len(shares)} shares) the formula does not make"
    )


# members of a tpm2 pin that widen its policy beyond the PCRs (clevis-pin-tpm2's signed
# policies): a binding with them opens in ways the pillar does not name
WIDER_TPM2_POLICY = ("policy_pubkey_path", "policy_path", "policy_ref")
PCR_IDS = re.compile(r"^(?:[0-9]{1,2}(?:,[0-9]{1,2})*)?$")


def _tpm2_policy(tpm2):
    """{"pcr_bank", "pcr_ids"} of a tpm2 pin; the bank is None when no PCR is named (Clevis
    writes no bank then, and none matters)."""
    wider = [m for m in WIDER_TPM2_POLICY if m in tpm2]
    if wider:
        raise ClevisPolicyError(f"a tpm2 pin with {', '.join(wider)}: a policy beyond the PCRs")
    ids = tpm2.get("pcr_ids", "")
    if isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        ids = ",".join(str(i) for i in ids)
    if not isinstance(ids, str) or not PCR_IDS.match(ids):
        raise ClevisPolicyError(f"a tpm2 pin's pcr_ids are not PCR numbers: {str(ids)[:40]!r}")
    pcr_ids = sorted({int(i) for i in ids.split(",") if i})
    bank = tpm2.get("pcr_bank", "sha1") if pcr_ids else None  # sha1: old Clevis's default
    if (pcr_ids and not isinstance(bank, str)) or not all(0 <= i <= 23 for i in pcr_ids):
        raise ClevisPolicyError(f"a tpm2 pin's PCRs: {str(bank)[:20]!r} {pcr_ids!r}")
    return {"pcr_bank": bank, "pcr_ids": pcr_ids}


def tpm2_share(token):
    """The compact JWE of the TPM2 share of a Clevis token (its whole JWE for a tpm2 pin; the
    tpm2 share of an sss), or None: what ``clevis decrypt`` unseals with the TPM alone, without
    asking any Tang server. ``token``: the token's JSON (cryptsetup token export)."""
    try:
        jwe = token["jwe"]
        clevis = _protected_header(jwe["protected"])["clevis"]
        if clevis["pin"] == "tpm2":
            return ".".join(
                jwe.get(part, "") for part in ("protected", "encrypted_key", "iv", "ciphertext", "tag")
            )
        if clevis["pin"] == "sss":
            for compact in clevis["sss"]["jwe"]:
                if _protected_header(compact.split(".")[0])["clevis"]["pin"] == "tpm2":
                    return compact
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError):
        return None
    return None


def _protected_header(text):
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        header = json.loads(raw)
    except (binascii.Error, ValueError, TypeError) as error:
        raise ValueError(f"JWE protected header: {error}") from None
    if not isinstance(header, dict):
        raise ValueError("JWE protected header is not an object")
    return header


def _tang_server(tang, header):
    keys = tang["adv"]["keys"]
    signing = [k for k in keys if "verify" in (k.get("key_ops") or [])]
    return {
        "url": tang["url"],
        "thumbprints": [t for key in signing for t in jwk_thumbprints(key)],
        "kid": header.get("kid"),
    }


# RFC 7638: the members of a public key that its thumbprint covers
THUMBPRINT_MEMBERS = {"EC": ("crv", "kty", "x", "y"), "RSA": ("e", "kty", "n"), "OKP": ("crv", "kty", "x")}


def jwk_thumbprints(key):
    """The SHA-256 and SHA-1 RFC 7638 thumbprints of a JWK (base64url, no padding); Tang names
    its keys by the first, older Tang and Clevis by the second."""
    members = THUMBPRINT_MEMBERS[key["kty"]]
    canonical = json.dumps({m: key[m] for m in members}, separators=(",", ":"), sort_keys=True).encode()
    return [
        base64.urlsafe_b64encode(hashlib.new(alg, canonical).digest()).rstrip(b"=").decode()
        for alg in ("sha256", "sha1")
    ]


def _segment(sid, seg):
    where = f"segment {sid}"
    kind = _field(seg, "type", str, where)
    result = {"id": sid, "type": kind, "offset": _int_text(seg.get("offset"), f"{where} offset")}
    size = seg.get("size")
    result["size"] = "dynamic" if size == "dynamic" else _int_text(size, f"{where} size")
    if kind == "crypt":
        result["encryption"] = _field(seg, "encryption", str, where)
        result["sector_size"] = _field(seg, "sector_size", int, where)
        result["iv_tweak"] = _int_text(seg.get("iv_tweak", "0"), f"{where} iv_tweak")
        if result["sector_size"] not in (512, 1024, 2048, 4096):
            raise LuksError(f"{where}: invalid sector_size {result['sector_size']}")
    return result


def _volume_keys(digests):
    """Which volume key each keyslot holds a copy of: the id of the LUKS2 digest that names it
    (``"0"``; during a re-encryption the new key's digest is another). A keyslot whose digest
    names no segment (``luksAddKey --unbound`` gives it one of its own) or that no digest names
    holds no volume key. Ids only: a digest's value never leaves."""
    volume_key_of = {}
    for did, digest in _numbered(digests, "digest"):
        slots, segments = digest.get("keyslots"), digest.get("segments")
        if not isinstance(slots, list) or not all(isinstance(k, str) for k in slots):
            raise LuksError(f"digest {did}: 'keyslots' is not a list of keyslot ids")
        if not isinstance(segments, list) or not all(isinstance(k, str) for k in segments):
            raise LuksError(f"digest {did}: 'segments' is not a list of segment ids")
        if segments:
            volume_key_of.update(dict.fromkeys(slots, str(did)))
    return volume_key_of


def key_fingerprint(digest):
    """A volume key's name that says nothing of it: 16 hex digits of a SHA-256 over its LUKS2
    digest's salt and value (themselves in the header for anyone to read). Another key has
    another digest; a keyslot added or removed leaves it as it is."""
    where = "digest"
    salt, value = _field(digest, "salt", str, where), _field(digest, "digest", str, where)
    return hashlib.sha256(f"{salt}:{value}".encode()).hexdigest()[:16]


def _keys_in_use(digests):
    """The fingerprints of the volume keys whose digests name a segment, sorted."""
    return sorted(
        key_fingerprint(digest) for _, digest in _numbered(digests, "digest") if digest.get("segments")
    )


def _keyslot(kid, slot):
    """A keyslot: a ``luks2`` one holds a copy of the volume key behind a KDF; a ``reencrypt`` one
    (``cryptsetup reencrypt``, from --init-only until the end) holds no key and has no KDF, only
    the re-encryption's mode, direction and resilience area. Its ``kdf`` is None."""
    where = f"keyslot {kid}"
    kind = _field(slot, "type", str, where)
    result = {
        "id": kid,
        "type": kind,
        "key_size": _field(slot, "key_size", int, where) * 8,
        "priority": slot.get("priority", 1) if isinstance(slot.get("priority", 1), int) else 1,
        "kdf": None,
        # the keyslot itself (its salt and area): the same in a header and its backup, another one
        # for a keyslot removed and added again under the same number
        "fingerprint": hashlib.sha256(json.dumps(slot, sort_keys=True).encode()).hexdigest()[:16],
    }
    if kind == "reencrypt":
        result["mode"] = _field(slot, "mode", str, where)
        result["direction"] = _field(slot, "direction", str, where)
        area = slot.get("area")
        resilience = area.get("type") if isinstance(area, dict) else None
        result["resilience"] = resilience if isinstance(resilience, str) else None
        return result
    if kind != "luks2" and "kdf" not in slot:
        return result  # a keyslot type of a later LUKS2 revision: reported, not judged here
    kdf = _field(slot, "kdf", dict, where)
    kdf_type = _field(kdf, "type", str, f"{where} kdf")
    summary = {"type": kdf_type}
    if kdf_type == "pbkdf2":
        summary["hash"] = _field(kdf, "hash", str, f"{where} kdf")
        summary["iterations"] = _field(kdf, "iterations", int, f"{where} kdf")
    elif kdf_type in ("argon2i", "argon2id"):
        for key in ("time", "memory", "cpus"):
            summary[key] = _field(kdf, key, int, f"{where} kdf")
    result["kdf"] = summary
    return result


def reencrypt_requirement(name):
    """True for the LUKS2 requirements that mark a re-encryption in progress: cryptsetup's
    ``online-reencrypt`` and ``online-reencrypt-v<N>`` (lib/luks2/luks2_json_metadata.c), and
    ``offline-reencrypt`` (the legacy offline tool)."""
    if name in ("online-reencrypt", "offline-reencrypt"):
        return True
    suffix = name[len("online-reencrypt-v") :] if name.startswith("online-reencrypt-v") else ""
    return suffix.isdigit() and suffix.isascii()


def _reencryption(keyslots, requirements, meta_segments):
    """The re-encryption fact, or None: in progress from ``cryptsetup reencrypt --init-only`` (or
    the start of a reencrypt) until it completes and cryptsetup removes keyslot and requirement.

    {"in_progress": True, "mode": reencrypt|encrypt|decrypt, "direction": forward|backward,
    "resilience": checksum|journal|datashift|none|..., "keyslot": id, "requirement": name,
    "target": {"encryption", "sector_size"} of the segment it re-encrypts to (None: to plaintext)}
    """
    slot = next((s for s in keyslots if s["type"] == "reencrypt"), None)
    requirement = next((r for r in requirements if isinstance(r, str) and reencrypt_requirement(r)), None)
    if slot is None and requirement is None:
        return None
    final = next((s for s in meta_segments.values() if "backup-final" in _list(s.get("flags"))), None)
    target = None
    if final is not None and final.get("type") == "crypt":
        encryption, sector_size = final.get("encryption"), final.get("sector_size")
        target = {
            "encryption": encryption if isinstance(encryption, str) else None,
            "sector_size": sector_size
            if isinstance(sector_size, int) and not isinstance(sector_size, bool)
            else None,
        }
    return {
        "in_progress": True,
        "mode": slot["mode"] if slot else None,
        "direction": slot["direction"] if slot else None,
        "resilience": slot["resilience"] if slot else None,
        "keyslot": slot["id"] if slot else None,
        "requirement": requirement,
        "target": target,
    }


# ---- helpers -------------------------------------------------------------------------------


def _numbered(mapping, what):
    if not isinstance(mapping, dict):
        raise LuksError(f"{what}s are not a JSON object")
    items = []
    for key, value in mapping.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 10):
            raise LuksError(f"{what} id {key!r} is not a number")
        if not isinstance(value, dict):
            raise LuksError(f"{what} {key} is not a JSON object")
        items.append((int(key), value))
    return sorted(items, key=lambda item: item[0])


def _list(value):
    return value if isinstance(value, list) else []


def _field(mapping, key, kind, where):
    value = mapping.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise LuksError(f"{where}: {key!r} missing or not a {kind.__name__}")
    return value


def _int_text(value, where):
    """LUKS2 stores 64-bit numbers as decimal strings."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 20:
        return int(value)
    raise LuksError(f"{where}: {value!r} is not a decimal string")


def _text(raw, what):
    text = raw.split(b"\0", 1)[0]
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError:
        raise LuksError(f"{what} is not UTF-8") from None
    if not decoded.isprintable():
        raise LuksError(f"{what} holds control characters")
    return decoded


def _u16(raw, offset):
    return struct.unpack_from(">H", raw, offset)[0]


def reader_for(data):
    """A ``read`` callable over bytes (tests, and callers that already hold the bytes)."""

    def read(offset, size):
        return bytes(data[offset : offset + size])

    return read
