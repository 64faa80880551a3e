"""Attack 4 on the Clevis proofs (254c4ba): "no PCR record is written for a keyslot about to be
unbound" holds for FIPS-refused keyslots only, not for the ones the new proof finds dead.

A TPM2 device under FIPS: keyslot 1 a PBKDF2 binding without a PCR record (its TPM2 share
unseals, so it is counted `unrecorded`), keyslot 2 an old clevis's argon2 binding. Keyslot 1 must
now open its own keyslot before keyslot 2 goes; it does not (its token's passphrase is not its
keyslot's), so it joins `dead` and `old_slots` - but stays in `unrecorded`. The state binds
anew, then imports a PCR record token for keyslot 1, then unbinds keyslot 1 and removes the
record again as stale; it reports `pcrs_recorded: [1]` for a keyslot it removed, and in test mode
says it would both "record the PCRs of keyslots ['1']" and remove keyslot 1.

Pure logic (the device is a small model of a LUKS2 header the commands act on, as
tests/unit/test_attack3_fips_clevis_2.py)."""

# ruff: noqa: F811, F401

from unittest.mock import MagicMock

from tests.unit.test_attack3_fips_clevis_2 import ARGON2, PBKDF2, POLICY, Device, wire
from tests.unit.test_states import (
    LV,
    configure_loader_modules,
    dry_run,
    marks,
    opts,
    pillar_data,
    salt_functions,
    scratch,
    states,
)
from tests.unit.test_tpm2 import TPM2_BINDING


def wire_two(salt_functions):
    device = wire(salt_functions)
    device.keyslots = {0: PBKDF2, 1: PBKDF2, 2: ARGON2}
    device.tokens = {
        0: {"type": "clevis", "keyslots": ["1"], "clevis": dict(TPM2_BINDING)},
        1: {"type": "clevis", "keyslots": ["2"], "clevis": dict(TPM2_BINDING)},
    }
    # keyslot 1's own keyslot does not open with what its token decrypts; any new one does
    salt_functions["hana_storage_host.clevis_opens"] = MagicMock(
        side_effect=lambda name, slot: {
            "opens": str(slot) != "1",
            "error": None if str(slot) != "1" else "no",
        }
    )
    return device


def test_no_pcr_record_is_made_for_a_binding_the_proof_found_dead(salt_functions, scratch, tmp_path):
    recovery = tmp_path / "recovery.key"
    recovery.write_bytes(b"r" * 64)
    device = wire_two(salt_functions)
    ret = states.clevis_bound(LV, str(recovery), POLICY, fips=True)
    assert ret["result"] is True, ret
    assert sorted(device.keyslots) == [0, 3], device.keyslots  # both replaced by keyslot 3
    assert ["1"] not in device.imported, (device.imported, ret["changes"])
    assert 1 not in ret["changes"].get("pcrs_recorded", []), ret["changes"]


def test_in_test_mode_it_does_not_say_it_would_record_the_pcrs_of_a_binding_it_removes(
    salt_functions, dry_run, tmp_path
):
    recovery = tmp_path / "recovery.key"
    recovery.write_bytes(b"r" * 64)
    wire_two(salt_functions)
    ret = states.clevis_bound(LV, str(recovery), POLICY, fips=True)
    assert ret["result"] is None, ret
    assert "keyslots [1, 2]" in ret["comment"], ret["comment"]  # it would remove keyslot 1...
    assert "record the PCRs of keyslots ['1']" not in ret["comment"], ret["comment"]  # ...not record it
