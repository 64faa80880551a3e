"""Attack on the FIPS Clevis replacement, with the TPM2's PCR records: a TPM2 binding without a
PCR record (made before the formula kept records) whose keyslot is argon2. Under FIPS it is to be
replaced, yet the state still counts it as `unrecorded`: it imports a PCR record token for the
very keyslot it unbinds a moment later, reports `pcrs_recorded: [1]` for a keyslot that is gone,
and in test mode says it would "record the PCRs of keyslots ['1']".

Pure logic (the device is a small model of a LUKS2 header the commands act on)."""

# ruff: noqa: F811, F401

import json

from hana_storage_core import tpm

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

POLICY = {"tang": None, "tpm2": {"pcr_bank": "sha256", "pcr_ids": [7]}}
NOW = {7: "22" * 32}
PBKDF2 = {"type": "pbkdf2", "hash": "sha256", "iterations": 1000}
ARGON2 = {"type": "argon2id", "time": 4, "memory": 32, "cpus": 1}


class Device:
    """Keyslot 0 the recovery key's (pbkdf2), keyslot 1 an old clevis's TPM2 binding (argon2id),
    no PCR record."""

    def __init__(self):
        self.keyslots = {0: PBKDF2, 1: ARGON2}
        self.tokens = {0: {"type": "clevis", "keyslots": ["1"], "clevis": dict(TPM2_BINDING)}}
        self.imported = []

    def header(self, *_args):
        return {
            "uuid": "u-1",
            "flags": [],
            "keyslots": [
                {"id": i, "type": "luks2", "kdf": dict(k), "priority": 1, "volume_key": "0"}
                for i, k in sorted(self.keyslots.items())
            ],
            "tokens": [{"id": i, **t} for i, t in sorted(self.tokens.items())],
        }

    def run(self, argv, **kwargs):
        if argv[:3] == ["clevis", "luks", "bind"]:
            slot = min(set(range(32)) - set(self.keyslots))
            self.keyslots[slot] = PBKDF2
            self.tokens[min(set(range(32)) - set(self.tokens))] = {
                "type": "clevis",
                "keyslots": [str(slot)],
                "clevis": dict(TPM2_BINDING),
            }
        elif argv[:3] == ["clevis", "luks", "unbind"]:
            slot = argv[argv.index("-s") + 1]
            del self.keyslots[int(slot)]
            for tid in [
                i for i, t in self.tokens.items() if t["type"] == "clevis" and t["keyslots"] == [slot]
            ]:
                del self.tokens[tid]
            for token in self.tokens.values():  # luksKillSlot unassigns it from every token
                token["keyslots"] = [s for s in token["keyslots"] if s != slot]
        elif argv[:3] == ["cryptsetup", "token", "import"]:
            raw = json.loads(kwargs["stdin"])
            self.imported.append(raw["keyslots"])
            self.tokens[min(set(range(32)) - set(self.tokens))] = {
                "type": tpm.PCR_TOKEN,
                "keyslots": raw["keyslots"],
                "pcrs": tpm.pcr_record(raw),
            }
        elif argv[:3] == ["cryptsetup", "token", "remove"]:
            del self.tokens[int(argv[argv.index("--token-id") + 1])]
        return {"retcode": 0, "stdout": "", "stderr": ""}


def wire(salt_functions):
    device = Device()
    salt_functions["hana_storage_host.luks_header"].side_effect = device.header
    salt_functions["cmd.run_all"].side_effect = device.run
    salt_functions["hana_storage_host.pcr_drift"] = lambda name: tpm.pcr_drift(
        device.header(), {"sha256": NOW}
    )
    salt_functions["hana_storage_host.pcr_values"] = lambda bank, ids: dict(NOW)
    return device


def test_under_fips_no_pcr_record_is_made_for_the_binding_being_replaced(salt_functions, scratch, tmp_path):
    recovery = tmp_path / "recovery.key"
    recovery.write_bytes(b"r" * 64)
    device = wire(salt_functions)
    ret = states.clevis_bound(LV, str(recovery), POLICY, fips=True)
    assert ret["result"] is True, ret
    assert sorted(device.keyslots) == [0, 2], device.keyslots  # replaced, as it should be
    # the defect: a PCR record written for keyslot 1, then orphaned by unbinding keyslot 1
    assert ["1"] not in device.imported, device.imported
    assert 1 not in ret["changes"].get("pcrs_recorded", []), ret["changes"]


def test_in_test_mode_it_does_not_say_it_would_record_the_pcrs_of_the_binding_it_replaces(
    salt_functions, dry_run, tmp_path
):
    recovery = tmp_path / "recovery.key"
    recovery.write_bytes(b"r" * 64)
    wire(salt_functions)
    ret = states.clevis_bound(LV, str(recovery), POLICY, fips=True)
    assert ret["result"] is None, ret
    assert "record the PCRs of keyslots ['1']" not in ret["comment"], ret["comment"]
