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

import shutil
import subprocess
import time

import pytest

from tests.unit.test_readiness import host, import_clevis_token, luks_image  # noqa: F401 - fixture

pytestmark = pytest.mark.skipif(not shutil.which("clevis"), reason="clevis is not installed")


@pytest.fixture(scope="module")
def token_on_two_keyslots(tmp_path_factory):
    image = luks_image(tmp_path_factory.mktemp("two-keyslots"), keyslots=(1, 2))
    import_clevis_token(image, ["1", "2"], b"second")
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
