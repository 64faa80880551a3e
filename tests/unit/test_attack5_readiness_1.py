"""Regression (attack review of b1f422b): with two Clevis tokens on one keyslot, the readiness
check must decrypt the token the boot's agent decrypts, or it says "ready" for a device the boot
cannot open.

b1f422b's ``core.luks.clevis_jwe`` returned the first matching token in the order the header's
JSON object lists them. Clevis itself (``clevis_luks_read_slot``, used by ``clevis-luks-askpass`` at boot
and by ``clevis luks pass``) picks the token with ``cryptsetup luksDump | grep -B1 "Keyslot: N" |
sed -n 1p``, i.e. the lowest token id, because luksDump prints tokens in id order 0..31. The two
orders differ whenever a token with a higher id was added before one with a lower id (cryptsetup
keeps json-c's insertion order: ``token import --token-id 1`` then ``--token-id 0`` writes
``{"1": ..., "0": ...}``).

Trigger (real cryptsetup and real clevis, null pin, no Tang needed): keyslot 1 opens with
"second"; token 1 (imported first) decrypts to "second", token 0 (imported second) decrypts to
"wrong". The boot's clevis reads token 0 for keyslot 1 and fails (``clevis luks pass -s 1``
exits 1, shown below as the oracle). b1f422b's ``_clevis_pass`` read token 1 and reported exit
0, so ``boot_path``/``boot_readiness`` said Clevis unlocks the line: a device that stays locked at the
next boot is reported ready, which is exactly what the check exists to prevent (and the old
``clevis luks pass`` based check got right).
"""

# ruff: noqa: F811

import shutil
import subprocess
import time

import pytest

from tests.unit.test_readiness import host, import_clevis_token, luks_image  # noqa: F401 - fixture

pytestmark = pytest.mark.skipif(not shutil.which("clevis"), reason="clevis is not installed")


@pytest.fixture(scope="module")
def two_tokens_one_keyslot(tmp_path_factory):
    image = luks_image(tmp_path_factory.mktemp("two-tokens"))
    # token 1 first (it decrypts to keyslot 1's passphrase), then token 0 (it does not)
    for token_id, secret in (("1", b"second"), ("0", b"wrong")):
        import_clevis_token(image, ["1"], secret, token_id)
    return image


def test_the_token_the_check_decrypts_is_the_one_the_boot_s_clevis_reads(host, two_tokens_one_keyslot):
    image = str(two_tokens_one_keyslot)
    # the oracle: what clevis (the same code as the boot's askpass) makes of keyslot 1
    boot = subprocess.run(["clevis", "luks", "pass", "-d", image, "-s", "1"], capture_output=True)
    assert boot.returncode != 0, "set-up: the boot's clevis was expected to read token 0 and fail"

    header = host.luks_header(image)
    verdict = host._clevis_unlocks(image, header, 60, time.monotonic() + 240)
    assert verdict["unlocks"] is False, (
        "boot readiness says Clevis unlocks keyslot 1, but the boot's clevis reads token 0 "
        f"(the lowest id) for it, which does not open: {verdict}"
    )
