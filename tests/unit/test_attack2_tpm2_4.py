"""Re-review #4 and #6 (regression): with the recovery key's file not in place, which keyslots it
opens cannot be told, so no keyslot is removed (a forged token on the recovery keyslot would
otherwise be unbound); and test=True says the same refusal as the real run."""

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


def test_a_missing_key_file_refuses_to_remove_any_keyslot(salt_functions):
    headers(salt_functions, [tpm2_token(0), record_token(0, 1, {7: "11" * 32})])
    salt_functions["hana_storage_host.pcr_drift"] = lambda device: {"0": [7]}
    ret = states.clevis_bound(LV, "/nowhere/recovery.key", POLICY, reseal=True)
    assert ret["result"] is False and "not there" in ret["comment"] and argvs_run(salt_functions) == []


def test_test_mode_refuses_what_the_real_run_refuses(salt_functions, opts, recovery):
    headers(salt_functions, [tpm2_token(0), record_token(0, 1, {7: "11" * 32})])
    salt_functions["hana_storage_host.pcr_drift"] = lambda device: {"0": [7]}
    salt_functions["hana_storage_host.key_slots"].return_value = {"keyslots": [0], "error": None}
    results = []
    for test in (True, False):
        opts["test"] = test
        results.append(states.clevis_bound(LV, str(recovery), POLICY, reseal=True))
    assert [r["result"] for r in results] == [False, False]
    assert all("opened by the recovery" in r["comment"] for r in results) and argvs_run(salt_functions) == []
