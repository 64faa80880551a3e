"""Attack 1: a TPM2 policy without PCRs (schema: "none: this TPM whatever boots") makes the
formula's own binding "foreign". clevis-encrypt-tpm2 writes pcr_bank into the JWE header only
when pcr_ids is given; the parser then defaults the bank to sha1 while the plan says sha256."""

import base64
import json
import shutil
import subprocess

import pytest
from hana_storage_core import commands, luks, rules

from tests.unit.test_audit import KEY_FILE, plan_of
from tests.unit.test_tpm2 import with_key


def b64(obj):
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()


def clevis19_tpm2_token(tpm2_header):
    """A Clevis token as clevis 19's tpm2 pin writes it (protected header only matters)."""
    header = {"alg": "dir", "enc": "A256GCM", "clevis": {"pin": "tpm2", "tpm2": tpm2_header}}
    return {
        "type": "clevis",
        "keyslots": ["1"],
        "jwe": {"protected": b64(header), "iv": "", "ciphertext": "", "tag": ""},
    }


@pytest.mark.parametrize("tpm2", [{}, {"pcr_ids": []}, {"pcr_bank": "sha256"}])
def test_a_pcr_less_tpm2_binding_the_formula_made_is_the_pillars(tpm2):
    policy = plan_of(
        with_key({"source": "tpm2", "tpm2": tpm2, "recovery": {"source": "keyfile", "path": KEY_FILE}})
    )["volumes"]["data"]["key"]["clevis"]
    pin, config = commands.clevis_config(policy)
    assert (pin, json.loads(config)) == ("tpm2", {})  # no PCR: no bank either
    # clevis 19 (bash pin): with no pcr_ids, neither pcr_bank nor pcr_ids goes into the header
    binding = luks.clevis_binding(
        clevis19_tpm2_token({"hash": "sha256", "key": "ecc", "jwk_pub": "x", "jwk_priv": "y"})
    )
    assert rules.binding_verdict(binding, policy) == "matches", (binding, policy)


@pytest.mark.skipif(
    not shutil.which("swtpm") or not shutil.which("clevis-encrypt-tpm2"), reason="no swtpm/clevis tpm2"
)
def test_the_real_clevis_binding_without_pcrs_reads_back_as_the_pillars(tmp_path):
    from swtpm_server import SwtpmServer

    policy = {"tang": None, "tpm2": {"pcr_bank": None, "pcr_ids": []}}
    image, key = tmp_path / "h.img", tmp_path / "k"
    key.write_bytes(b"r" * 64)
    subprocess.run(["truncate", "-s", "20M", str(image)], check=True)
    subprocess.run(
        [
            "cryptsetup",
            "luksFormat",
            "-q",
            "--type",
            "luks2",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--key-file",
            str(key),
            str(image),
        ],
        check=True,
    )
    with SwtpmServer(tmp_path) as tpm:
        done = tpm.run(*commands.clevis_bind(str(image), str(key), policy))
        assert done.returncode == 0, done.stderr
    header = luks.parse_header(luks.reader_for(image.read_bytes()))
    (token,) = [t for t in header["tokens"] if t["type"] == "clevis"]
    assert rules.binding_verdict(token["clevis"], policy) == "matches", token["clevis"]
    # what follows today: pillar_clevis_keyslots leaves the keyslot out -> the proven header
    # backup is refused (HANA-KEY-005), the next clevis_bound refuses (HANA-KEY-003)
    assert rules.pillar_clevis_keyslots(header, policy) == {"1"}
