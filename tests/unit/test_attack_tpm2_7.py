"""Attack 7: the pillar may seal to PCRs that are extended after the boot (10: IMA; 11:
systemd-pcrphase / UKI phases; 15: systemd-pcrmachine/pcrfs/cryptsetup measurements; 23:
application) or reset at will (16: debug PCR, resettable from locality 0). Clevis seals to the
values *now* (the running system's), which no boot reproduces when systemd-cryptsetup runs: the
line never opens at boot, while readiness (`clevis luks pass` now) says ready; and with IMA
(PCR 10 grows all the time) every apply sees a "changed PCR" and binds again. PCR 16 protects
nothing. Such PCRs should be refused (or need an explicit override)."""

import pytest

from tests.unit.test_audit import KEY_FILE
from tests.unit.test_tpm2 import errors, with_key


@pytest.mark.parametrize("pcr", [10, 11, 15, 16, 23])
def test_a_pcr_no_boot_reproduces_is_refused(pcr):
    key = {
        "source": "tpm2",
        "tpm2": {"pcr_ids": [7, pcr]},
        "recovery": {"source": "keyfile", "path": KEY_FILE},
    }
    assert errors(with_key(key)) != []
