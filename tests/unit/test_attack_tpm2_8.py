"""Attack 8: `tpm2: {}` is a valid TPM2 policy (schema: no required member; clevis_policy makes
it sha256 with no PCR), but packages.jinja tests `key.get('tpm2')`, which is falsy for {}: a
Tang key with `tpm2: {}` gets an sss needing the TPM2 and no TPM2 pin (Debian: clevis-tpm2)
nor tpm2-tools installed, so `clevis luks bind` fails on a fresh host."""

import pytest
import salt.utils.yaml

from tests.support.sls import render


@pytest.mark.parametrize(
    "family,tpm2", [("Debian", "clevis-tpm2"), ("Suse", "tpm2.0-tools"), ("RedHat", "tpm2-tools")]
)
def test_an_empty_tpm2_policy_still_installs_the_tpm2_pin(tmp_path, family, tpm2):
    key = {"source": "tang", "tpm2": {}}
    states = salt.utils.yaml.safe_load(
        render(tmp_path, "packages.sls", family, pillar={"hana": {"storage": {"key": key}}})
    )
    (pkgs,) = [p["pkgs"] for p in states["hana-storage-packages"]["pkg.installed"] if "pkgs" in p]
    assert tpm2 in pkgs, pkgs
