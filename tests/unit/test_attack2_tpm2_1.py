"""Re-review #1 (regression): a Tang outage, or a binding whose PCRs changed, must never cost a
device its only working Clevis binding. "Dead" is decided from the TPM2 share alone
(hana_storage_host.tpm2_unseals: clevis decrypt of that share, no Tang asked), so a Tang outage
is not taken for a changed PCR; a binding is freed to make room only when the TPM still does not
unseal it; and a failure after that says the device has no binding now."""

# ruff: noqa: F811, F401
from unittest.mock import MagicMock

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
from tests.unit.test_tpm2 import NOW, SERVER, TPM2, headers, recovery

POLICY = {"tang": {"servers": [SERVER], "threshold": 1}, "tpm2": TPM2}
BINDING = {
    "pin": "sss",
    "threshold": 1,
    "servers": [{"url": SERVER["url"], "thumbprints": [SERVER["thumbprint"]], "kid": "k"}],
    "tpm2": TPM2,
}


def token(slot, token_id=0):
    return {"id": token_id, "type": "clevis", "keyslots": [str(slot)], "clevis": dict(BINDING)}


def argvs(salt_functions):
    return [c.args[0] for c in salt_functions["cmd.run_all"].call_args_list]


def tang_down(salt_functions, bind_fails=True):
    """Tang does not answer: Clevis opens nothing, a bind cannot fetch the advertisement."""
    salt_functions["hana_storage_host.clevis_opens"].return_value = {"opens": False, "error": "Tang down"}
    salt_functions["hana_storage_host.pcr_values"] = lambda bank, ids: dict(NOW)

    def run(argv, **kwargs):
        failed = bind_fails and argv[:3] == ["clevis", "luks", "bind"]
        return {"retcode": 1 if failed else 0, "stdout": "", "stderr": "Unable to fetch advertisement"}

    salt_functions["cmd.run_all"] = MagicMock(side_effect=run)


def test_a_tang_outage_is_not_called_a_dead_tpm2_binding(salt_functions):
    headers(salt_functions, [token(1)])  # no PCR record: the TPM is asked about its share alone
    salt_functions["hana_storage_host.pcr_drift"] = lambda device: {}
    tang_down(salt_functions)
    ret = states.clevis_bound(LV, "/k", POLICY)
    assert ret["result"] is True and "tpm2_reseal" not in ret["comment"], ret
    assert [a[:3] for a in argvs(salt_functions)] == [["cryptsetup", "token", "import"]]  # its record


def test_with_reseal_a_tang_outage_leaves_the_good_binding_alone(salt_functions, recovery):
    headers(salt_functions, [token(1)])
    salt_functions["hana_storage_host.pcr_drift"] = lambda device: {}
    tang_down(salt_functions)
    ret = states.clevis_bound(LV, str(recovery), POLICY, reseal=True)
    assert not [
        a
        for a in argvs(salt_functions)
        if a[:3] in (["clevis", "luks", "unbind"], ["clevis", "luks", "bind"])
    ]
    assert ret["result"] is True, ret


def test_a_binding_freed_for_room_is_said_to_be_gone_when_the_bind_then_fails(salt_functions, recovery):
    headers(salt_functions, [token(1)])
    salt_functions["hana_storage_host.pcr_drift"] = lambda device: {"1": [7]}  # PCR 7 changed
    salt_functions["hana_storage_host.tpm2_unseals"].return_value = {
        "unseals": False,
        "error": "policy check",
    }
    tang_down(salt_functions)  # the bind fails (no room, or Tang down), freeing room does not help
    ret = states.clevis_bound(LV, str(recovery), POLICY, reseal=True)
    assert ret["result"] is False and ret["changes"]["unbound"] == {"keyslots": [1]}
    assert "no Clevis binding now" in ret["comment"] and "kept the old binding" not in ret["comment"], ret


def test_a_binding_the_tpm_still_unseals_is_never_freed_for_room(salt_functions, recovery):
    headers(salt_functions, [token(1)])
    salt_functions["hana_storage_host.pcr_drift"] = lambda device: {"1": [7]}
    tang_down(salt_functions)  # tpm2_unseals says yes when asked again before freeing: keep it
    ret = states.clevis_bound(LV, str(recovery), POLICY, reseal=True)
    assert ret["result"] is False and "unbound" not in ret["changes"]
    assert not [a for a in argvs(salt_functions) if a[:3] == ["clevis", "luks", "unbind"]]
