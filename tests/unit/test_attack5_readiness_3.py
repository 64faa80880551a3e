"""Defect: when the two LUKS2 header copies disagree, the readiness check decrypts a token from
the copy cryptsetup (and so the boot's clevis) does not use, and says "ready" for a device the
boot cannot open.

``core.luks.clevis_jwe`` takes the token from ``_best_luks2_copy``: the copy with the higher
seqid among those whose checksum and JSON *syntax* are fine. cryptsetup also validates each
copy's JSON semantically (``LUKS2_hdr_validate``: every keyslot a token names must exist, ...)
and uses the other copy when one fails. The passphrase test (``cryptsetup open
--test-passphrase``) and the boot's agent (``clevis_luks_read_slot`` reads ``cryptsetup
luksDump``) then see the other copy's tokens, while the JWE handed to ``clevis decrypt`` came
from the copy cryptsetup rejected. Before this change ``clevis luks pass`` read the token through
cryptsetup and saw what the boot sees.

Trigger (real cryptsetup and clevis, null pin): both copies, seqid S, hold token 0 for keyslot 1
that decrypts to "wrong"; keyslot 1 opens with "second". The primary is rewritten (valid
checksum, seqid S+1) so that token 0 decrypts to "second" and an extra token names keyslot 9,
which does not exist: cryptsetup ignores that primary. The boot's clevis (``clevis luks pass -s
1``, the oracle) fails; ``_clevis_unlocks`` says Clevis unlocks the line.
"""

# ruff: noqa: F811

import hashlib
import json
import shutil
import struct
import subprocess
import time

import pytest

from tests.unit.test_readiness import host  # noqa: F401 - fixture

HEADER_COPY = 4 << 20  # bytes of the image: its whole header (metadata 16 KiB, keyslots 1 MiB)

pytestmark = pytest.mark.skipif(not shutil.which("clevis"), reason="clevis is not installed")

METADATA = 16 << 10


def _jwe(secret):
    compact = subprocess.run(
        ["clevis", "encrypt", "null", "{}"], input=secret, capture_output=True, check=True
    ).stdout
    return json.loads(
        subprocess.run(["jose", "jwe", "fmt", "-i-"], input=compact, capture_output=True, check=True).stdout
    )


@pytest.fixture(scope="module")
def copies_that_disagree(tmp_path_factory):
    folder = tmp_path_factory.mktemp("copies")
    image, first, second = folder / "luks.img", folder / "first.key", folder / "second.key"
    image.write_bytes(bytes(HEADER_COPY))
    first.write_bytes(b"first")
    second.write_bytes(b"second")
    fast = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]
    for argv in (
        ["luksFormat", "-q", "--type", "luks2", *fast, "--luks2-metadata-size", "16k"]
        + ["--luks2-keyslots-size", "1m", "--key-file", str(first), str(image)],
        ["luksAddKey", "-q", *fast, "--key-slot", "1", "--key-file", str(first), str(image), str(second)],
    ):
        subprocess.run(["cryptsetup", *argv], check=True, capture_output=True)
    subprocess.run(
        ["cryptsetup", "token", "import", "--token-id", "0", str(image)],
        input=json.dumps({"type": "clevis", "keyslots": ["1"], "jwe": _jwe(b"wrong")}).encode(),
        check=True,
        capture_output=True,
    )
    data = bytearray(image.read_bytes())
    hdr_size, seqid = struct.unpack_from(">QQ", data, 8)
    assert hdr_size == METADATA
    metadata = json.loads(bytes(data[4096:hdr_size]).split(b"\0", 1)[0])
    metadata["tokens"]["0"]["jwe"] = _jwe(b"second")
    metadata["tokens"]["5"] = {"type": "user-defined", "keyslots": ["9"]}
    text = json.dumps(metadata).encode()
    data[4096:hdr_size] = text + bytes(hdr_size - 4096 - len(text))
    struct.pack_into(">Q", data, 16, seqid + 1)
    data[448:512] = bytes(64)
    digest = hashlib.sha256(bytes(data[:hdr_size])).digest()
    data[448 : 448 + len(digest)] = digest
    image.write_bytes(bytes(data))
    return image


def test_the_token_decrypted_is_from_the_copy_cryptsetup_uses(host, copies_that_disagree, tmp_path):
    image = str(copies_that_disagree)
    header = host.luks_header(image)
    assert header["tokens"][0]["keyslots"] == ["1"], header["tokens"]  # set-up: the primary is read
    # the oracle runs on a copy: cryptsetup repairs the primary it rejected from the secondary
    spare = tmp_path / "spare.img"
    shutil.copyfile(image, spare)
    boot = subprocess.run(["clevis", "luks", "pass", "-d", str(spare), "-s", "1"], capture_output=True)
    assert boot.returncode != 0, "set-up: the boot's clevis was expected to read the secondary's token"

    verdict = host._clevis_unlocks(image, header, 60, time.monotonic() + 240)
    assert verdict["unlocks"] is False, (
        "boot readiness says Clevis unlocks keyslot 1 with the primary copy's token, but cryptsetup "
        f"rejects that copy and the boot's clevis decrypts the secondary's token, which does not open: {verdict}"
    )
