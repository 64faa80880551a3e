"""Defect: a Clevis token that lists two keyslots is one the boot's agent uses, but the readiness
check (and ``clevis_opens``, which the bind state trusts) says it does not open.

``core.luks.clevis_jwe`` only takes a token whose ``keyslots`` is exactly ``[keyslot]``; for a
token such as ``{"type": "clevis", "keyslots": ["1", "2"], ...}`` it returns None and
``_clevis_pass`` answers ``(1, "keyslot 1 has no Clevis token of its own")``. ``_clevis_unlocks``
nevertheless tries that token's first keyslot, so the line is reported ``clevis_fails``.
Clevis itself does not care: ``clevis_luks_read_slot`` (``clevis-luks-askpass`` at boot, and
``clevis luks pass``) finds the token for keyslot 1 with ``luksDump | grep -B1 "Keyslot: 1" |
sed -n 1p``, which is the token's own ``N: clevis`` line when 1 is its first keyslot, decrypts
it and hands the passphrase on. The check used ``clevis luks pass`` before this change and got
this right; the commit claims "the boot's agent decrypts the same JWE", which is not so here.

Trigger (real cryptsetup and clevis, null pin): keyslots 1 and 2 exist, one token lists both and
decrypts to keyslot 1's passphrase. ``clevis luks pass -d img -s 1`` succeeds (oracle), so the
boot opens the device; ``_clevis_unlocks`` says it does not, and ``clevis_opens(img, 1)`` says
False, a false alarm that sends the operator to rebind a working binding (and makes the bind
state treat a working binding as unproven, one to be replaced).
"""

# ruff: noqa: F811

import json
import shutil
import subprocess
import time

import pytest

from tests.unit.test_readiness import host  # noqa: F401 - fixture

HEADER_COPY = 4 << 20  # bytes of the image: its whole header (metadata 16 KiB, keyslots 1 MiB)

pytestmark = pytest.mark.skipif(not shutil.which("clevis"), reason="clevis is not installed")


@pytest.fixture(scope="module")
def token_on_two_keyslots(tmp_path_factory):
    folder = tmp_path_factory.mktemp("two-keyslots")
    image, first, second = folder / "luks.img", folder / "first.key", folder / "second.key"
    image.write_bytes(bytes(HEADER_COPY))
    first.write_bytes(b"first")
    second.write_bytes(b"second")
    fast = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]
    for argv in (
        ["luksFormat", "-q", "--type", "luks2", *fast, "--luks2-metadata-size", "16k"]
        + ["--luks2-keyslots-size", "1m", "--key-file", str(first), str(image)],
        ["luksAddKey", "-q", *fast, "--key-slot", "1", "--key-file", str(first), str(image), str(second)],
        ["luksAddKey", "-q", *fast, "--key-slot", "2", "--key-file", str(first), str(image), str(second)],
    ):
        subprocess.run(["cryptsetup", *argv], check=True, capture_output=True)
    compact = subprocess.run(
        ["clevis", "encrypt", "null", "{}"], input=b"second", capture_output=True, check=True
    ).stdout
    jwe = json.loads(
        subprocess.run(["jose", "jwe", "fmt", "-i-"], input=compact, capture_output=True, check=True).stdout
    )
    subprocess.run(
        ["cryptsetup", "token", "import", str(image)],
        input=json.dumps({"type": "clevis", "keyslots": ["1", "2"], "jwe": jwe}).encode(),
        check=True,
        capture_output=True,
    )
    return image


def test_a_token_on_two_keyslots_that_the_boot_s_clevis_uses_is_no_clevis_failure(
    host, token_on_two_keyslots
):
    image = str(token_on_two_keyslots)
    boot = subprocess.run(["clevis", "luks", "pass", "-d", image, "-s", "1"], capture_output=True)
    assert boot.returncode == 0, f"set-up: the boot's clevis was expected to open keyslot 1: {boot.stderr}"

    verdict = host._clevis_unlocks(image, host.luks_header(image), 60, time.monotonic() + 240)
    assert verdict["unlocks"] is True, f"the boot's clevis opens keyslot 1, the check says no: {verdict}"
    assert host.clevis_opens(image, 1) == {"opens": True, "error": None}
