"""Unit-tier fixtures: real LUKS headers from `cryptsetup luksFormat` on plain files.

luksFormat needs no device-mapper, so headers for every LUKS version, cipher, sector size, KDF
and label are made here for real; `cryptsetup luksDump --dump-json-metadata` is the reference the
parser is checked against. Persistent flags need an open device (dm), so those headers were
recorded in the lab VM (tests/unit/data/lab-mix) or are made by editing a real header's JSON and
re-checksumming it, which cryptsetup itself then has to accept.
"""

import base64
import hashlib
import json
import shutil
import struct
import subprocess

import pytest
from hana_storage_core import luks

from tests.conftest import REPO
from tests.support.redis_store import redis_server

DATA = REPO / "tests" / "unit" / "data"
CHEAP_KDF = {
    "pbkdf2": ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"],
    "argon2i": ["--pbkdf", "argon2i", "--pbkdf-memory", "8192", "--pbkdf-force-iterations", "4"],
    "argon2id": [
        "--pbkdf",
        "argon2id",
        "--pbkdf-memory",
        "8192",
        "--pbkdf-force-iterations",
        "4",
        "--pbkdf-parallel",
        "1",
    ],
}


def cryptsetup(*args, check=True):
    if not shutil.which("cryptsetup"):
        pytest.skip("cryptsetup not installed (make deps installs cryptsetup-bin)")
    return subprocess.run(["cryptsetup", *args], capture_output=True, text=True, check=check)


@pytest.fixture(scope="session")
def keyfile(tmp_path_factory):
    path = tmp_path_factory.mktemp("key") / "k.key"
    path.write_bytes(base64.b64decode(base64.b64encode(bytes(range(64)))))
    path.chmod(0o400)
    return path


@pytest.fixture(scope="session")
def make_luks(tmp_path_factory, keyfile):
    """make_luks(type='luks2', cipher=..., key_size=..., sector_size=..., kdf=..., extra=[]) -> path."""
    counter = iter(range(10**6))

    def make(
        type="luks2", cipher="aes-xts-plain64", key_size=512, sector_size=None, kdf="argon2id", extra=()
    ):
        path = tmp_path_factory.mktemp("luks") / f"hdr{next(counter)}.img"
        subprocess.run(["truncate", "-s", "24M", str(path)], check=True)
        args = [
            "luksFormat",
            "-q",
            "--type",
            type,
            "--cipher",
            cipher,
            "--key-size",
            str(key_size),
            "--key-file",
            str(keyfile),
            *CHEAP_KDF[kdf],
            *extra,
        ]
        if sector_size:
            args += ["--sector-size", str(sector_size)]
        cryptsetup(*args, str(path))
        return path

    return make


def dump_json(path):
    """cryptsetup's own view of a LUKS2 header."""
    return json.loads(cryptsetup("luksDump", "--dump-json-metadata", str(path)).stdout)


def rechecksum(data, offset):
    """Recompute the sha256 checksum of the LUKS2 header copy at offset (bytearray, in place)."""
    hdr_size = struct.unpack_from(">Q", data, offset + 8)[0]
    data[offset + 448 : offset + 512] = bytes(64)
    digest = hashlib.sha256(bytes(data[offset : offset + hdr_size])).digest()
    data[offset + 448 : offset + 448 + len(digest)] = digest
    return data


def rewrite_luks2_json(image, edit):
    """Change the JSON of both LUKS2 header copies of an image and fix their checksums."""
    data = bytearray(image.read_bytes())
    hdr_size = struct.unpack_from(">Q", data, 8)[0]
    for offset in (0, hdr_size):
        area = data[offset + 4096 : offset + hdr_size]
        meta = json.loads(bytes(area).split(b"\0", 1)[0])
        edit(meta)
        text = json.dumps(meta).encode()
        data[offset + 4096 : offset + hdr_size] = text + bytes(hdr_size - 4096 - len(text))
        rechecksum(data, offset)
    image.write_bytes(bytes(data))
    return image


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server for the tier: the triage store several masters share."""
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


def full_audits_in_the_tick(beacon):
    """Run a beacon module's full audits in the tick that starts them, not in a thread: what one
    tick reports is then certain. tests/unit/test_beacon_state.py runs the thread itself."""

    class InTheTick(beacon.FullAudit):
        def _start(self, audit, record):
            self.run(audit, record)

        def done(self):
            return True

    beacon.FullAudit = InTheTick
    return beacon


def reencrypt_offline(path, keyfile, *args):
    """`cryptsetup reencrypt` of an image file (offline: no mapping), with ``args``
    (--init-only, --resume-only, or nothing for the whole run); a new volume key goes to the
    keyslot the key file opens (its id changes with each re-encryption)."""
    if "--resume-only" not in args:
        header = luks.parse_header(luks.reader_for(path.read_bytes()))
        (slot,) = [k["id"] for k in header["keyslots"] if k["type"] == "luks2"][:1]
        args = ("--key-slot", str(slot), *args)
    run = ["cryptsetup", "reencrypt", "-q", "--force-offline-reencrypt", "--resilience", "checksum",
           "--key-file", str(keyfile), *CHEAP_KDF["pbkdf2"], *args, str(path)]  # fmt: skip
    done = subprocess.run(run, capture_output=True, text=True)
    if done.returncode and "force-offline-reencrypt" in done.stderr:
        pytest.skip("cryptsetup before 2.5")
    assert done.returncode == 0, (run, done.stdout, done.stderr)
