"""Attack 4: a run killed between `clevis luks bind` and the PCR record's `cryptsetup token
import` (or one whose import failed: result False) leaves a TPM2 binding without a record. The
next apply calls it "bound" (True, no changes) and never records it: from then on a PCR change
is never named by readiness and never re-bound by the state. The same holds for a binding that
no longer unseals for any reason the record cannot see (a replaced vTPM, a TPM clear: new SRK,
same PCR values) - the state never asks whether the binding actually opens, though
readiness' tpm_unreadable fix text tells people that state.apply binds again."""

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
from tests.unit.test_tpm2 import NOW, POLICY, argvs_run, headers, tpm2_token


def test_a_tpm2_binding_left_without_its_pcr_record_gets_one(salt_functions):
    headers(salt_functions, [tpm2_token(1)], [tpm2_token(1)], [tpm2_token(1)])
    salt_functions["hana_storage_host.pcr_drift"] = lambda device: {}  # no record: nothing compared
    salt_functions["hana_storage_host.pcr_values"] = lambda bank, ids: dict(NOW)
    ret = states.clevis_bound(LV, "/k", POLICY)
    assert ["cryptsetup", "token", "import"] in [a[:3] for a in argvs_run(salt_functions)], ret
