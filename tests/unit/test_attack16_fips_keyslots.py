# ruff: noqa: F811 - the fixtures imported below are parameters of the tests
"""Attack 16: ``hana_storage.fips_keyslots`` (state ``<volume>-fips-<n>``), with the real
cryptsetup 2.6.1 on image files. Each test fails on the change as it stands, for the reason its
docstring gives.

What ``cryptsetup luksConvertKey --key-slot N`` (the same keyslot number) writes, measured with
strace: (1) the keyslot's area overwritten with random bytes (LUKS2_keyslot_wipe), fsync; (2, 3)
the new key material into the same area, fsync; (4-6) the primary header (binary, JSON, binary
with checksum), fsync; (7-9) the secondary one, fsync. Between the first write and the sixth the
header on disk still names the old argon2 keyslot while its area holds other bytes: the key
opens nothing. The volume's key file has one keyslot (luksFormat's) on every volume the formula
made, so a kill there (the minion restarted, OOM, a reboot, power) leaves a volume no key opens:
the dm mapping still runs, the next close or boot loses the data, unless the optional header
backup (off by default, and taken after this step) is restored.
"""

import hashlib
import shutil
import subprocess

import pytest

from tests.unit.conftest import CHEAP_KDF
from tests.unit.test_states import (  # noqa: F401 - fixtures
    configure_loader_modules,
    marks,
    opts,
    pillar_data,
    real_headers,
    run_cryptsetup,
    salt_functions,
    scratch,
    states,
    tabs,
)

FIPS_PBKDF = {"type": "pbkdf2", "hash": "sha256", "force_iterations": 1000}
ARGON2 = CHEAP_KDF["argon2id"]
# the n-th write(2) of luksConvertKey: 2 after the area was wiped, 4 after the new key material,
# 6 before the primary header's checksummed binary header
KILL_POINTS = [2, 4, 6]


def needs_strace():
    if not shutil.which("strace"):
        pytest.skip("strace not installed")


WRITERS = ("luksConvertKey", "luksAddKey", "luksKillSlot")


def killed_at(write, command):
    """cmd.run_all that runs cryptsetup for real, its ``command`` (one of WRITERS) killed
    (SIGKILL) as it enters its ``write``-th write(2)."""

    def run(argv, **kwargs):
        if argv[:2] == ["cryptsetup", command]:
            argv = ["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=write",
                    "-e", f"inject=write:signal=SIGKILL:when={write}", *argv]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True)
        return {"retcode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}

    return run


def tear(image, keyfile, write):
    """What a luksConvertKey of keyslot 0 killed at its ``write``-th write leaves on ``image``."""
    argv = ["cryptsetup", "luksConvertKey", "--batch-mode", "--key-slot", "0", "--pbkdf", "pbkdf2",
            "--hash", "sha256", "--pbkdf-force-iterations", "1000", "--key-file", str(keyfile), str(image)]  # fmt: skip
    assert killed_at(write, "luksConvertKey")(argv)["retcode"] != 0


@pytest.mark.parametrize("command", ["luksAddKey", "luksKillSlot"])
@pytest.mark.parametrize("write", KILL_POINTS)
def test_a_conversion_killed_at_any_write_leaves_a_device_the_key_opens(
    real_headers, salt_functions, make_luks, keyfile, write, command
):
    """Attack: the apply is killed while fips_keyslots makes the key's only keyslot (a volume the
    formula formatted: one keyslot, argon2id before compliance:fips was set) PBKDF2: inside the
    luksAddKey of the new keyslot, or inside the luksKillSlot of the old one.

    Expected: at every kill point the key still opens the device, and the next run ends with the
    key opening it through PBKDF2-SHA256 keyslots only. (In place, as luksConvertKey does it -
    the keyslot's area rewritten before its header - a kill at write 2, 4 or 6 left a device no
    key opens: test_the_next_run_after_a_killed_conversion_does_not_report_success.)"""
    needs_strace()
    image = make_luks()
    assert real_headers.key_slots(str(image), str(keyfile))["keyslots"] == [0]
    salt_functions["cmd.run_all"].side_effect = killed_at(write, command)
    states.fips_keyslots(str(image), str(keyfile), FIPS_PBKDF)
    opened = real_headers.key_slots(str(image), str(keyfile))
    assert opened["keyslots"], (
        f"{command} killed at write {write}: the key opens no keyslot any more ({opened})"
    )
    salt_functions["cmd.run_all"].side_effect = run_cryptsetup
    again = states.fips_keyslots(str(image), str(keyfile), FIPS_PBKDF)
    assert again["result"] is True, again
    header = real_headers.luks_header(str(image))
    assert states.core.kdf.not_fips_usable(header["keyslots"]) == []
    assert real_headers.key_slots(str(image), str(keyfile))["keyslots"] == [
        int(s["id"]) for s in header["keyslots"]
    ]


@pytest.mark.parametrize("write", KILL_POINTS)
def test_the_next_run_after_a_killed_conversion_does_not_report_success(
    real_headers, make_luks, keyfile, write
):
    """Attack: the header a killed luksConvertKey leaves (above). The next apply runs
    fips_keyslots again.

    Impact: the header parses, keyslot 0 is argon2id (refused), the key opens no keyslot and
    _key_slots has no error, so ``ours`` is empty and the state answers result True: "the key
    ... opens no keyslot of ... that FIPS mode refuses; keyslots [0] are not the key's: a person
    converts them". luks_opened does not test an open device's key, header_backed_up finds the
    backup "current" (same metadata): the apply is green on a volume nothing opens after the next
    reboot. The same holds for a key file that simply does not open the device.

    Expected: result False, saying the key opens no keyslot of the device."""
    needs_strace()
    image = make_luks()
    tear(image, keyfile, write)
    assert real_headers.key_slots(str(image), str(keyfile)) == {"keyslots": [], "error": None}
    ret = states.fips_keyslots(str(image), str(keyfile), FIPS_PBKDF)
    assert ret["result"] is False, ret


def test_a_key_that_opens_no_keyslot_at_all_is_not_reported_as_fine(real_headers, make_luks, tmp_path):
    """Attack: the key file on the host does not open the device (replaced by hand, a pillar key
    changed without key:previous, the torn header above). Impact: result True, "the key ...
    opens no keyslot ... that FIPS mode refuses", and the device's argon2 keyslot is blamed on
    "another passphrase". Expected: result False: the volume's key must open the volume."""
    image, wrong = make_luks(), tmp_path / "wrong.key"
    wrong.write_bytes(b"w" * 64)
    ret = states.fips_keyslots(str(image), str(wrong), FIPS_PBKDF)
    assert ret["result"] is False, ret


def test_a_degraded_header_is_refused_and_not_rewritten(real_headers, make_luks, keyfile):
    """Attack: a LUKS2 header whose primary copy is damaged (HANA-ENC-007), its keyslot argon2id.

    Impact: luksConvertKey loads the header, repairs the damaged copy from the other one as it
    does, and converts: the damage HANA-ENC-007 reports is erased before anyone looked at it,
    and the conversion is built on whichever copy cryptsetup chose. clevis_bound refuses exactly
    this ("clevis luks bind would rewrite it as it loads it, erasing what shows the damage"),
    and _key_test works on an in-memory copy for the same reason; fips_keyslots does neither.

    Expected: refused, not a byte of the device changed."""
    image = make_luks()
    data = bytearray(image.read_bytes())
    data[4096 + 512 : 4096 + 1024] = bytes(512)  # a sector of the primary JSON area
    image.write_bytes(bytes(data))
    assert real_headers.luks_header(str(image))["degraded"] is True
    before = hashlib.sha256(image.read_bytes()).hexdigest()
    ret = states.fips_keyslots(str(image), str(keyfile), FIPS_PBKDF)
    assert ret["result"] is False, ret
    assert hashlib.sha256(image.read_bytes()).hexdigest() == before


def test_keyslots_the_key_could_not_be_tried_on_are_not_called_another_passphrases(
    real_headers, salt_functions, make_luks, keyfile
):
    """Attack: two keyslots of the key, one argon2id (0), one PBKDF2-SHA1 (1); trying keyslot 0
    fails (out of memory for its argon2, or a host already in FIPS mode where cryptsetup cannot
    derive argon2: exit 1), keyslot 1 opens. ``ours`` is [1], so the error is dropped.

    Impact: keyslot 1 is converted, and the state says result True, "keyslots [0] are not the
    key's: a person converts them (HANA-ENC-008)": a false statement, the boot under FIPS still
    tries an argon2 keyslot of the key, and the cause (the error) is not shown.

    Expected: not True, and keyslot 0 not blamed on another passphrase."""
    image = make_luks()
    subprocess.run(["cryptsetup", "luksAddKey", "-q", "--pbkdf", "pbkdf2", "--pbkdf-force-iterations",
                    "1000", "--hash", "sha1", "--key-file", str(keyfile), str(image), str(keyfile)], check=True)  # fmt: skip
    real = salt_functions["hana_storage_host.key_slots"].side_effect

    def key_slots(device, key_file):
        found = real(device, key_file)
        if 0 in found["keyslots"]:
            found["keyslots"].remove(0)
            found["error"] = "keyslot 0: cryptsetup exited 1 (wrong parameters): "
        return found

    salt_functions["hana_storage_host.key_slots"].side_effect = key_slots
    ret = states.fips_keyslots(str(image), str(keyfile), FIPS_PBKDF)
    assert "not the key's" not in ret["comment"], ret
    assert ret["result"] is not True, ret


def test_a_conversion_that_fails_on_the_second_keyslot_reports_the_first(
    real_headers, salt_functions, make_luks, keyfile
):
    """Attack: the key opens two argon2id keyslots; a PBKDF2 one is added, keyslot 0 removed,
    and the removal of keyslot 1 fails. Expected: the changes name what was done."""
    image = make_luks()
    subprocess.run(["cryptsetup", "luksAddKey", "-q", *ARGON2, "--key-file", str(keyfile), str(image), str(keyfile)],
                   check=True)  # fmt: skip

    def run(argv, **kwargs):
        if argv[:2] == ["cryptsetup", "luksKillSlot"] and argv[-1] == "1":
            return {"retcode": 1, "stdout": "", "stderr": "Device or resource busy."}
        return run_cryptsetup(argv, **kwargs)

    salt_functions["cmd.run_all"].side_effect = run
    ret = states.fips_keyslots(str(image), str(keyfile), FIPS_PBKDF)
    assert ret["result"] is False
    assert ret["changes"] == {"enrolled": {"keyslots": [2]}, "removed": {"keyslots": [0]}}, ret


def test_an_unbound_keyslot_is_not_one_a_person_must_convert(real_headers, make_luks, keyfile, tmp_path):
    """Attack: a keyslot added with ``luksAddKey --unbound`` (another passphrase, argon2id).
    cryptsetup 2.6.1 gives an unbound keyslot a digest of its own with no segment; the parser
    (core.luks._volume_keys) takes any digest for a volume key, so kdf.derived_at_boot counts it.
    A boot never tries it (``cryptsetup open`` without --key-slot: "No usable keyslot is
    available"). Impact: the state says "keyslots [1] are not the key's: a person converts them
    (HANA-ENC-008)" and a key's own unbound keyslot is converted needlessly. Expected: the unbound
    keyslot is not named."""
    image, other = make_luks(kdf="pbkdf2"), tmp_path / "other.key"
    other.write_bytes(b"o" * 64)
    subprocess.run(["cryptsetup", "luksAddKey", "-q", "--unbound", "--key-size", "512", *ARGON2,
                    "--key-file", str(keyfile), str(image), str(other)], check=True)  # fmt: skip
    ret = states.fips_keyslots(str(image), str(keyfile), FIPS_PBKDF)
    assert ret["result"] is True and "[1]" not in ret["comment"], ret
