"""Regression (attack review of b1f422b): when the two LUKS2 header copies disagree, the
readiness check must decrypt the token of the copy cryptsetup (and so the boot's clevis) uses,
or it says "ready" for a device the boot cannot open.

b1f422b's ``core.luks.clevis_jwe`` took the token from ``_best_luks2_copy``: the copy with the higher
seqid among those whose checksum and JSON *syntax* are fine. cryptsetup also validates each
copy's JSON semantically (``LUKS2_hdr_validate``: every keyslot a token names must exist, ...)
and uses the other copy when one fails. The passphrase test (``cryptsetup open
--test-passphrase``) and the boot's agent (``clevis_luks_read_slot`` reads ``cryptsetup
luksDump``) then see the other copy's tokens, while the JWE handed to ``clevis decrypt`` came
from the copy cryptsetup rejected. ``clevis luks pass`` read the token through
cryptsetup and saw what the boot sees.

Trigger (real cryptsetup and clevis, null pin): both copies, seqid S, hold token 0 for keyslot 1
that decrypts to "wrong"; keyslot 1 opens with "second". The primary is rewritten (valid
checksum, seqid S+1) so that token 0 decrypts to "second" and an extra token names keyslot 9,
which does not exist: cryptsetup ignores that primary. The boot's clevis (``clevis luks pass -s
1``, the oracle) fails; b1f422b's ``_clevis_unlocks`` said Clevis unlocks the line.
"""

# ruff: noqa: F811

import hashlib
import json
import shutil
import struct
import subprocess
import time

import pytest

from tests.unit.test_readiness import host, import_clevis_token, luks_image, null_jwe  # noqa: F401 - fixture

pytestmark = pytest.mark.skipif(not shutil.which("clevis"), reason="clevis is not installed")

METADATA = 16 << 10


@pytest.fixture(scope="module")
def copies_that_disagree(tmp_path_factory):
    image = luks_image(tmp_path_factory.mktemp("copies"))
    import_clevis_token(image, ["1"], b"wrong", "0")
    data = bytearray(image.read_bytes())
    hdr_size, seqid = struct.unpack_from(">QQ", data, 8)
    assert hdr_size == METADATA
    metadata = json.loads(bytes(data[4096:hdr_size]).split(b"\0", 1)[0])
    metadata["tokens"]["0"]["jwe"] = null_jwe(b"second")
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
