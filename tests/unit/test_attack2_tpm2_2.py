"""Re-review #2 (regression): a TPM2 binding whose recorded PCRs are unchanged but that the TPM no
longer unseals (the TPM was cleared, or the vTPM replaced: a new storage seed, the same boot
chain) is bound again when the apply is told to reseal; without it the state says so. A host
with no TPM at all cannot be bound to one: the state fails, with or without reseal."""

# ruff: noqa: F811, F401
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
from tests.unit.test_tpm2 import NOW, POLICY, argvs_run, headers, record_token, recovery, tpm2_token


def test_a_binding_a_new_tpm_cannot_unseal_is_bound_again_with_reseal(salt_functions, recovery):
    headers(
        salt_functions,
        [tpm2_token(1), record_token(1, 1, NOW)],
        [tpm2_token(1), record_token(1, 1, NOW), tpm2_token(2, 2)],
    )
    salt_functions["hana_storage_host.pcr_drift"] = lambda device: {"1": []}  # same PCR values
    salt_functions["hana_storage_host.pcr_values"] = lambda bank, ids: dict(NOW)
    salt_functions["hana_storage_host.tpm2_unseals"].return_value = {
        "unseals": False,
        "error": "integrity check failed",
    }
    ret = states.clevis_bound(LV, str(recovery), POLICY, reseal=True)
    assert ret["result"] is True, ret
    run = [a[:3] for a in argvs_run(salt_functions)]
    assert ["clevis", "luks", "bind"] in run and ["clevis", "luks", "unbind"] in run


def test_no_tpm_fails_with_or_without_reseal(salt_functions):
    headers(salt_functions, [tpm2_token(1), record_token(1, 1, NOW)])
    salt_functions["hana_storage_host.pcr_drift"] = lambda device: {"error": "this host has no TPM"}
    for reseal in (False, True):
        ret = states.clevis_bound(LV, "/k", POLICY, reseal=reseal)
        assert ret["result"] is False and "cannot be checked" in ret["comment"]
    assert argvs_run(salt_functions) == []
