"""Attack 9: Clevis token headers the parser reads wrong or crashes on.

(a) A JWE protected header nested ~1500 deep ("[[[...]]]", 2.7 KB base64: fits a token, and
`cryptsetup token import` accepts it - cryptsetup never decodes the JWE) raises RecursionError
out of clevis_binding -> luks.parse_header -> every audit/state on the device (pre-existing in
_protected_header, but clevis_binding is what this commit rewrote).

(b) clevis-pin-tpm2 (the Rust pin RHEL 9 ships; clevis-encrypt-tpm2 execs it when installed)
honours policy_pubkey_path/policy_ref/policy_path in a pin "tpm2" header (an authorized policy
OR'd with the PCR one: opens on any boot state a signed policy allows). The parser ignores those
members and calls such a binding the pillar's PCR binding ("matches")."""

import base64
import json

from hana_storage_core import luks, rules


def b64(raw):
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def token(protected):
    return {
        "type": "clevis",
        "keyslots": ["1"],
        "jwe": {"protected": protected, "iv": "", "ciphertext": "", "tag": ""},
    }


def test_a_deeply_nested_protected_header_is_an_error_not_a_traceback():
    binding = luks.clevis_binding(token(b64(("[" * 1500 + "]" * 1500).encode())))
    assert "error" in binding


def test_a_tpm2_binding_with_an_authorized_policy_is_not_the_pillars_pcr_binding():
    header = {
        "alg": "dir",
        "enc": "A256GCM",
        "clevis": {
            "pin": "tpm2",
            "tpm2": {
                "hash": "sha256",
                "key": "ecc",
                "jwk_pub": "x",
                "jwk_priv": "y",
                "pcr_bank": "sha256",
                "pcr_ids": "7",
                "policy_pubkey_path": "/etc/clevis/policy.pub",
                "policy_path": "/etc/clevis/policy.json",
            },
        },
    }
    binding = luks.clevis_binding(token(b64(json.dumps(header).encode())))
    policy = {"tang": None, "tpm2": {"pcr_bank": "sha256", "pcr_ids": [7]}}
    assert rules.binding_verdict(binding, policy) == "foreign", binding
