"""Mutation fuzzer for every parser that reads what a host gives it.

    python tests/fuzz/fuzz_parsers.py [--inputs 100000] [--seed 1]

Seeds are real: LUKS1 and LUKS2 headers made by `cryptsetup luksFormat` (when cryptsetup is
installed) and headers, dm tables, LVM reports, mountinfo and XFS superblocks recorded in the
lab. Mutations are both blind (flip, overwrite, truncate, extend, splice bytes or tokens) and
structure-aware (edit a LUKS2 JSON leaf and fix both checksums; edit an LVM JSON leaf), so
inputs get past the magic and the checksum into the code behind them.

A parser may fail only with its own error (LuksError, DmTableError, ...). Anything else is a
crash: the input is kept in build/fuzz/ and the run exits 1. The count of inputs is printed.
"""

import argparse
import hashlib
import json
import pathlib
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "_utils")]

from hana_storage_core import crypto as kcrypto  # noqa: E402
from hana_storage_core import dm as dm  # noqa: E402
from hana_storage_core import luks as luks  # noqa: E402
from hana_storage_core import lvm as lvm  # noqa: E402
from hana_storage_core import tab as tab  # noqa: E402
from hana_storage_core import xfs as xfs  # noqa: E402

from tests.unit.conftest import CHEAP_KDF  # noqa: E402 - the unit tier's cheap KDF settings

DATA = REPO / "tests" / "unit" / "data" / "lab-mix"
# what Linux 6.18 wrote: an empty source, "\040" escapes, a source "-", a path that is not UTF-8
KERNEL_MOUNTINFO = REPO / "tests" / "unit" / "data" / "mountinfo" / "kernel-6.18-unshare.bin"
CRASHES = REPO / "build" / "fuzz"
INTERESTING = [0, 1, 0x7F, 0x80, 0xFF, 0xFFFF, 0xFFFFFFFF, 2**63 - 1, 2**64 - 1, 4096, 16384]
# "²" is a digit to str.isdigit() that int() refuses; "٣" is a decimal digit int() reads as 3
JSON_VALUES = [
    None,
    True,
    -1,
    0,
    2**70,
    1.5,
    "",
    "x" * 300,
    [],
    {},
    "aes-xts-plain64",
    "4096",
    "-1",
    "²",
    "٣",
]


def luks_read(image):
    return lambda offset, size: image[offset : offset + size]


# ---- seeds -----------------------------------------------------------------------------------


def cryptsetup_seeds():
    """Fresh LUKS1 and LUKS2 headers (a few options each); none without cryptsetup."""
    if not shutil.which("cryptsetup"):
        return []
    seeds = []
    with tempfile.TemporaryDirectory() as tmp:
        key = pathlib.Path(tmp) / "key"
        key.write_bytes(bytes(range(32)))
        variants = [
            ["--type", "luks1", *CHEAP_KDF["pbkdf2"], "--hash", "sha256"],
            ["--type", "luks2", *CHEAP_KDF["pbkdf2"], "--label", "fz"],
            ["--type", "luks2", *CHEAP_KDF["argon2id"], "--sector-size", "4096"]
            + ["--cipher", "aes-cbc-essiv:sha256", "--key-size", "256"],
        ]
        for i, extra in enumerate(variants):
            path = pathlib.Path(tmp) / f"h{i}.img"
            subprocess.run(["truncate", "-s", "20M", str(path)], check=True)
            done = subprocess.run(
                ["cryptsetup", "luksFormat", "-q", *extra, "--key-file", str(key), str(path)],
                capture_output=True,
            )
            if done.returncode == 0:
                seeds.append(path.read_bytes()[: 1 << 20])
    return seeds


def seeds():
    headers = [p.read_bytes() for p in sorted(DATA.glob("hdr-*.bin"))] + cryptsetup_seeds()
    text = {name: (DATA / name).read_text() for name in ("dmsetup-table.txt", "mountinfo.txt")}
    return {
        "luks": headers,
        "dm": [text["dmsetup-table.txt"]],
        "crypto": [p.read_text() for p in sorted(DATA.parent.glob("proc-crypto-*.txt"))],
        "mountinfo": [
            text["mountinfo.txt"],
            KERNEL_MOUNTINFO.read_bytes().decode("utf-8", "backslashreplace"),
        ],
        "mountinfo-bytes": [(DATA / "mountinfo.txt").read_bytes(), KERNEL_MOUNTINFO.read_bytes()],
        "crypttab": [
            "hana_data UUID=1b4e28ba-2fa1-11d2-883f-0016d3cca427 /run/hana-storage/keys/hana.key "
            "luks,discard,no-read-workqueue,no-write-workqueue\n# comment\nswap /dev/sdb2 /dev/urandom swap\n"
        ],
        "fstab": [
            "UUID=0a3b /hana/data xfs inode64,noatime,nofail 0 0\n/dev/sda1 / ext4 defaults 0 1\n"
            "tmpfs /run tmpfs rw,nosuid 0 0\n"
        ],
        "blkid": ["DEVNAME=/dev/vda\nUUID=1b4e28ba\nTYPE=crypto_LUKS\nVERSION=2\nPTTYPE=gpt\n"],
        "lvs": [(DATA / "lvs-segments.json").read_text()],
        "pvs": [(DATA / "pvs.json").read_text()],
        "xfs": [p.read_bytes() for p in sorted(DATA.glob("xfs-sb-*.bin"))],
    }


# ---- mutations -------------------------------------------------------------------------------


def mutate_bytes(rng, data, limit=1 << 16):
    data = bytearray(data[:limit] if rng.random() < 0.9 else data)
    for _ in range(rng.randint(1, 8)):
        choice = rng.random()
        if not data or choice < 0.1:
            data += rng.randbytes(rng.randint(1, 64))
        elif choice < 0.45:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif choice < 0.65:
            value = rng.choice(INTERESTING)
            width = rng.choice((1, 2, 4, 8))
            at = rng.randrange(len(data))
            packed = (value % (1 << (8 * width))).to_bytes(width, rng.choice(("big", "little")))
            data[at : at + width] = packed
        elif choice < 0.8:
            del data[rng.randrange(len(data)) :]
        else:
            at = rng.randrange(len(data))
            data[at:at] = data[rng.randrange(len(data)) :][: rng.randint(1, 128)]
    return bytes(data)


def rechecksum(data, offset):
    hdr_size = struct.unpack_from(">Q", data, offset + 8)[0]
    if not 4096 < hdr_size <= len(data) - offset:
        return
    data[offset + 448 : offset + 512] = bytes(64)
    data[offset + 448 : offset + 480] = hashlib.sha256(bytes(data[offset : offset + hdr_size])).digest()


def mutate_json_leaf(rng, value, depth=0):
    """Return the value with one random leaf (or key) changed."""
    if isinstance(value, dict) and value and depth < 8:
        key = rng.choice(list(value))
        roll = rng.random()
        if roll < 0.15:
            value.pop(key)
        elif roll < 0.25:
            value[rng.choice(["x", "0", "-1", key + "_"])] = rng.choice(JSON_VALUES)
        else:
            value[key] = mutate_json_leaf(rng, value[key], depth + 1)
        return value
    if isinstance(value, list) and value and depth < 8:
        at = rng.randrange(len(value))
        value[at] = mutate_json_leaf(rng, value[at], depth + 1)
        return value
    return rng.choice(JSON_VALUES + [str(value) + "9", value])


def mutate_luks2_json(rng, image):
    """Edit the JSON area of both LUKS2 copies and fix the checksums: gets past the checksum."""
    data = bytearray(image)
    if data[:6] != b"LUKS\xba\xbe" or struct.unpack_from(">H", data, 6)[0] != 2:
        return mutate_bytes(rng, image)
    hdr_size = struct.unpack_from(">Q", data, 8)[0]
    if not 4096 < hdr_size <= len(data) // 2:
        return mutate_bytes(rng, image)
    try:
        meta = json.loads(bytes(data[4096:hdr_size]).split(b"\0", 1)[0])
    except ValueError:
        return mutate_bytes(rng, image)
    for _ in range(rng.randint(1, 3)):
        meta = mutate_json_leaf(rng, meta)
    text = json.dumps(meta).encode()[: hdr_size - 4096]
    for offset in (0, hdr_size):
        data[offset + 4096 : offset + hdr_size] = text + bytes(hdr_size - 4096 - len(text))
        rechecksum(data, offset)
    if rng.random() < 0.3:  # a damaged primary: the secondary must carry the read
        data[rng.randrange(512)] ^= 0xFF
    return bytes(data)


def mutate_text(rng, text):
    lines = text.splitlines(keepends=True) or [""]
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(lines))
        tokens = lines[i].split(" ")
        roll = rng.random()
        if roll < 0.3 and tokens:
            tokens[rng.randrange(len(tokens))] = rng.choice(
                [
                    "",
                    "0",
                    "-1",
                    "99999999999999999999",
                    "x",
                    "sector_size:513",
                    "1:2:3",
                    ":",
                    "\t",
                    "\\040",
                    "²",
                    "٣",
                ]
            )
        elif roll < 0.5 and tokens:
            del tokens[rng.randrange(len(tokens))]
        elif roll < 0.65:
            tokens.insert(rng.randrange(len(tokens) + 1), rng.choice(["1", "crypt", "-", "#", "=", "a=b"]))
        elif roll < 0.8:
            lines.insert(i, lines[rng.randrange(len(lines))])
        else:
            lines[i] = mutate_bytes(rng, lines[i].encode(), 512).decode("utf-8", "replace")
            continue
        lines[i] = " ".join(tokens)
    return "".join(lines)


def mutate_lvm_json(rng, text):
    try:
        data = json.loads(text)
    except ValueError:
        return mutate_text(rng, text)
    for _ in range(rng.randint(1, 3)):
        data = mutate_json_leaf(rng, data)
    return json.dumps(data) if rng.random() < 0.9 else json.dumps(data)[: rng.randrange(64)]


def mountinfo_lenient(text):
    """parse_mountinfo with a ``malformed`` list: every line is a mount or set aside, never both,
    never lost; TabError (counted as rejected) when any line was set aside."""
    malformed = []
    mounts = tab.parse_mountinfo(text, malformed=malformed)
    lines = [n for n, line in enumerate(text.split("\n"), 1) if line]
    if len(mounts) + len(malformed) != len(lines) or not {m["line"] for m in malformed} <= set(lines):
        raise AssertionError(f"{len(lines)} lines, {len(mounts)} mounts, {len(malformed)} set aside")
    for entry in malformed:
        if not entry["error"].startswith(f"mountinfo line {entry['line']} "):
            raise AssertionError(f"the error does not name its line: {entry}")
    if malformed:
        raise tab.TabError(malformed[0]["error"])
    return mounts


# ---- targets ---------------------------------------------------------------------------------

TARGETS = {
    # name: (seed kind, mutator, call, the parser's own error)
    "luks-bytes": ("luks", mutate_bytes, lambda d: luks.parse_header(luks_read(d)), luks.LuksError),
    "luks2-json": ("luks", mutate_luks2_json, lambda d: luks.parse_header(luks_read(d)), luks.LuksError),
    "dmsetup-table": ("dm", mutate_text, dm.parse_tables, dm.DmTableError),
    "proc-crypto": ("crypto", mutate_text, kcrypto.parse_proc_crypto, kcrypto.ProcCryptoError),
    "mountinfo": ("mountinfo", mutate_text, tab.parse_mountinfo, tab.TabError),
    "mountinfo-bytes": ("mountinfo-bytes", mutate_bytes, tab.parse_mountinfo, tab.TabError),
    "mountinfo-lax": ("mountinfo", mutate_text, mountinfo_lenient, tab.TabError),
    "crypttab": ("crypttab", mutate_text, tab.parse_crypttab, tab.TabError),
    "fstab": ("fstab", mutate_text, tab.parse_fstab, tab.TabError),
    "blkid-export": ("blkid", mutate_text, tab.parse_blkid_export, tab.TabError),
    "lvs-json": ("lvs", mutate_lvm_json, lvm.parse_segments, lvm.LvmReportError),
    "pvs-json": ("pvs", mutate_lvm_json, lvm.parse_pvs, lvm.LvmReportError),
    "xfs-superblock": ("xfs", mutate_bytes, xfs.parse_superblock, xfs.XfsError),
}
WEIGHTS = {"luks-bytes": 2, "luks2-json": 3}


def run(inputs, seed):
    rng = random.Random(seed)
    corpus = seeds()
    names = [n for n in TARGETS if corpus[TARGETS[n][0]]]
    weighted = [n for n in names for _ in range(WEIGHTS.get(n, 1))]
    counts = {n: {"inputs": 0, "parsed": 0, "rejected": 0} for n in names}
    crashes = []
    started = time.monotonic()
    for i in range(inputs):
        name = weighted[i % len(weighted)]
        kind, mutate, call, own_error = TARGETS[name]
        sample = mutate(rng, rng.choice(corpus[kind]))
        counts[name]["inputs"] += 1
        try:
            call(sample)
            counts[name]["parsed"] += 1
        except own_error:
            counts[name]["rejected"] += 1
        except Exception as error:  # noqa: BLE001 - this is what the fuzzer looks for
            CRASHES.mkdir(parents=True, exist_ok=True)
            path = CRASHES / f"crash-{name}-{i}.bin"
            path.write_bytes(sample if isinstance(sample, bytes) else sample.encode("utf-8", "surrogatepass"))
            crashes.append(f"{name}: {type(error).__name__}: {error} (input kept in {path})")
    seconds = time.monotonic() - started
    return {"inputs": inputs, "seconds": round(seconds, 1), "targets": counts, "crashes": crashes}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    result = run(args.inputs, args.seed)
    for name, count in result["targets"].items():
        print(
            f"  {name:15} {count['inputs']:7} inputs  {count['parsed']:6} parsed  {count['rejected']:6} rejected"
        )
    print(f"fuzzed {result['inputs']} inputs in {result['seconds']} s, {len(result['crashes'])} crashes")
    for crash in result["crashes"][:20]:
        print("CRASH", crash)
    return 1 if result["crashes"] else 0


if __name__ == "__main__":
    sys.exit(main())
