"""Attack 3: any apply re-seals a TPM2 binding to whatever the PCRs are now. Nothing in the
pillar says the PCR change was planned: an evil-maid change of the boot chain (Secure Boot off,
own keys enrolled: PCR 7) that makes the boot fall back to the recovery key is "blessed" by the
next (scheduled) highstate, after which the disk opens unattended under the attacker's boot
chain. readiness' own fix text says "if not [planned], find out what changed the boot chain
before anything else" - the state does not wait for that."""

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
from tests.unit.test_tpm2 import NOW, POLICY, argvs_run, headers, record_token, tpm2_token


def test_a_pcr_change_nobody_acknowledged_is_not_sealed_to(salt_functions):
    then = {7: "11" * 32}
    before = [tpm2_token(1), record_token(1, 1, then)]
    headers(
        salt_functions,
        before,
        [*before, tpm2_token(2, 2)],
        [record_token(1, 1, then), tpm2_token(2, 2), record_token(2, 3, NOW)],
    )
    salt_functions["hana_storage_host.pcr_drift"] = lambda device: {"1": [7]}
    salt_functions["hana_storage_host.pcr_values"] = lambda bank, ids: dict(NOW)
    ret = states.clevis_bound(LV, "/k", POLICY)  # the pillar names no new PCR value, no "reseal"
    assert not [a for a in argvs_run(salt_functions) if a[:3] == ["clevis", "luks", "bind"]], ret
    assert ret["result"] is False
