"""Re-review #3 (regression): two PCR records on one keyslot (a token imported twice) are no
record; the binding unseals, so the state records it once, replacing both, and the next apply
changes nothing (no new token on every apply)."""

# ruff: noqa: F811, F401
import json

from hana_storage_core import tpm

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
from tests.unit.test_tpm2 import NOW, POLICY, record_token, tpm2_token


def test_duplicate_records_are_replaced_once_and_the_next_apply_changes_nothing(salt_functions):
    tokens = [tpm2_token(1, 0), record_token(1, 1, NOW), record_token(1, 2, NOW)]

    def run(argv, **kwargs):  # the header changes as cryptsetup would change it
        if argv[:3] == ["cryptsetup", "token", "remove"]:
            tokens[:] = [t for t in tokens if t["id"] != int(argv[4])]
        elif argv[:3] == ["cryptsetup", "token", "import"]:
            raw = json.loads(kwargs["stdin"])
            tokens.append(
                {"id": 9, "type": tpm.PCR_TOKEN, "keyslots": raw["keyslots"], "pcrs": tpm.pcr_record(raw)}
            )
        return {"retcode": 0, "stdout": "", "stderr": ""}

    salt_functions["cmd.run_all"].side_effect = run
    salt_functions["hana_storage_host.luks_header"].side_effect = lambda *a: {
        "uuid": "u",
        "flags": [],
        "tokens": list(tokens),
    }
    salt_functions["hana_storage_host.pcr_drift"] = lambda d: tpm.pcr_drift(
        {"tokens": list(tokens)}, {"sha256": NOW}
    )
    salt_functions["hana_storage_host.pcr_values"] = lambda bank, ids: dict(NOW)
    first = states.clevis_bound(LV, "/k", POLICY)
    assert first["result"] is True and first["changes"]["pcrs_recorded"] == [1], first
    assert [t["id"] for t in tokens if t["type"] == tpm.PCR_TOKEN] == [9]
    again = states.clevis_bound(LV, "/k", POLICY)
    assert again["result"] is True and again["changes"] == {}, again
