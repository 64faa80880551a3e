"""Attack 10 (lockout): clevis_bound unbinds whatever keyslot a "matching" Clevis token names,
the recovery key's included. Two tokens written with plain `cryptsetup token import` (no key
needed, any header writer: a mistaken operator, an attacker who wants the formula to do the
deed) - a clevis token on keyslot 0 whose protected header reads as the pillar's TPM2 policy,
and a hana-storage-pcrs record on keyslot 0 with other values - make the next apply "bind
again" and then run `clevis luks unbind -s 0 -f`, which is `cryptsetup luksKillSlot -q`: the
recovery keyslot is gone, the volume opens only through the TPM (which the pillar docs say can
be lost). The Tang path has the same hole with a stale thumbprint (pre-existing)."""

# ruff: noqa: F811, F401
import base64
import json
import shutil
import subprocess

import pytest
from hana_storage_core import luks, tpm

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

pytestmark = pytest.mark.skipif(
    not shutil.which("cryptsetup") or not shutil.which("clevis"), reason="no cryptsetup/clevis"
)


def b64(obj):
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()


def forged_image(tmp_path):
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
    protected = {
        "alg": "dir",
        "enc": "A256GCM",
        "clevis": {
            "pin": "tpm2",
            "tpm2": {
                "hash": "sha256",
                "key": "ecc",
                "pcr_bank": "sha256",
                "pcr_ids": "7",
                "jwk_pub": "AA",
                "jwk_priv": "AA",
            },
        },
    }
    clevis = {
        "type": "clevis",
        "keyslots": ["0"],
        "jwe": {"protected": b64(protected), "iv": "", "ciphertext": "", "tag": ""},
    }
    record = json.loads(tpm.pcr_token(0, "sha256", {7: "00" * 32}))
    for token in (clevis, record):
        subprocess.run(
            ["cryptsetup", "token", "import", str(image)], input=json.dumps(token), text=True, check=True
        )
    return image, key


def test_clevis_bound_never_unbinds_the_recovery_keyslot(salt_functions, tmp_path):
    image, _key = forged_image(tmp_path)
    forged = luks.parse_header(luks.reader_for(image.read_bytes()))["tokens"]
    new = tpm2_token(1, token_id=2)
    headers(salt_functions, forged, [*forged, new], [*forged, new], [forged[1], new])
    salt_functions["hana_storage_host.pcr_drift"] = lambda device: tpm.pcr_drift(
        {"tokens": forged}, {"sha256": NOW}
    )
    salt_functions["hana_storage_host.pcr_values"] = lambda bank, ids: dict(NOW)
    ret = states.clevis_bound(LV, "/k", POLICY)
    unbinds = [a for a in argvs_run(salt_functions) if a[:3] == ["clevis", "luks", "unbind"]]
    # today: [['clevis', 'luks', 'unbind', '-d', LV, '-s', '0', '-f']] and result True
    # and that argv, run for real, kills keyslot 0 (the recovery key):
    done = subprocess.run(
        ["clevis", "luks", "unbind", "-d", str(image), "-s", "0", "-f"], capture_output=True, text=True
    )
    left = [k["id"] for k in luks.parse_header(luks.reader_for(image.read_bytes()))["keyslots"]]
    assert unbinds == [], (ret["comment"], unbinds, done.returncode, "keyslots left:", left)
