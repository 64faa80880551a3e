"""Attack 5: a PCR record token the state should just clean up blocks it for good. `_pcr_drift`
reads the PCRs of *every* hana-storage-pcrs token, orphans (keyslots []) included, and
pcr_record accepts any pcr_bank string; one record whose bank cannot be read (an attacker's
`cryptsetup token import` of {"type":"hana-storage-pcrs","keyslots":[],"pcr_bank":"sm3_256",...},
or a bank since de-allocated with tpm2_pcrallocate) makes clevis_bound fail with "its TPM2
binding cannot be checked" before it reaches the orphan cleanup that would remove it; readiness
reports tpm_unreadable for a binding that has no record at all."""

# ruff: noqa: F811, F401
import importlib.util
import json

from hana_storage_core import tpm

from tests.conftest import REPO
from tests.unit.test_states import (
    LV,
    configure_loader_modules,
    marks,
    opts,
    pillar_data,
    salt_functions,
    scratch,
    states,
)
from tests.unit.test_tpm2 import NOW, POLICY, argvs_run, headers, tpm2_token


def host_module():
    spec = importlib.util.spec_from_file_location(
        "host_module_attack5", REPO / "_modules" / "hana_storage_host.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stray(token_id, bank="sm3_256"):
    raw = {"type": tpm.PCR_TOKEN, "keyslots": [], "pcr_bank": bank, "values": {"7": "00" * 32}}
    return {"id": token_id, "type": tpm.PCR_TOKEN, "keyslots": [], "pcrs": tpm.pcr_record(raw)}


def test_a_stray_record_is_not_a_record_of_any_binding():
    header = {"tokens": [tpm2_token(1), stray(1)]}
    assert host_module()._pcr_drift(header) == {}  # today: {"error": "no PCR [7] in a bank 'sm3_256'"}


def test_a_stray_record_is_removed_not_a_reason_to_stop(salt_functions):
    headers(salt_functions, [tpm2_token(1), stray(1)], [tpm2_token(1), stray(1)])
    salt_functions["hana_storage_host.pcr_values"] = lambda bank, ids: dict(
        NOW
    )  # the binding opens: recorded
    module = host_module()
    salt_functions["hana_storage_host.pcr_drift"] = lambda device: module._pcr_drift(
        {"tokens": [tpm2_token(1), stray(1)]}
    )
    ret = states.clevis_bound(LV, "/k", POLICY)
    assert ret["result"] is True, ret
    assert ["cryptsetup", "token", "remove", "--token-id", "1", LV] in argvs_run(salt_functions)
