"""What encrypting a volume in place costs, in one boot of the lab (software emulation).

The volume of tests/vm/test_in_place.py: a striped LV (2 x 64 KiB) of LV_MIB MiB with an XFS and
96 MiB of data, encrypted in place by `state.apply hana.storage` with no cap on its I/O.

1. Rate: the bytes of the LV over the time the encryption unit ran (its journal's monotonic
   stamps), against two baselines of the same run: `dd` copying the same LV onto itself in place
   (each byte read and written once, as the encryption does; the XFS frozen meanwhile, so what
   dd writes back is what it read), and the cipher alone (`cryptsetup benchmark`, AES-XTS with
   a 512-bit key, encryption). The slower of the two bounds the encryption; the ratio against it
   is what cryptsetup's re-encryption (the data moved by the header area, its metadata kept
   current) keeps of it. Under software emulation the cipher is the bound, by far.
2. Downtime: the seconds between the unmount and the mount from the crypt device (the state's
   ``downtime_s``), HANA's only downtime.
"""

import pytest

from bench.conftest import Target
from bench.lab_rates import DD_RUNS, cipher_rates, dd_in_place_seconds, unit_seconds
from tests.vm.conftest import reencryption_underway, wait_for_unit_end
from tests.vm.test_in_place import (
    LV,
    LV_MIB,
    MOUNT,
    UNIT,
    failures,
    in_place_state,
    pillar,
    plain_lab,
)

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def vm(request):
    vm = plain_lab(request)
    vm.setup_salt(pillar(vm, max_mib_s=None))
    return vm


def test_in_place_rate_against_dd_and_the_downtime(vm, bench):
    baseline = [dd_in_place_seconds(vm, LV, LV_MIB, MOUNT) for _ in range(DD_RUNS)]
    ciphers = [cipher_rates(vm)[0] for _ in range(DD_RUNS)]  # encryption
    applied = vm.salt("state.apply hana.storage", title="state.apply: encrypt /hana/data in place, uncapped")
    assert applied.retcode == 0, failures(applied)
    downtime = in_place_state(applied)["changes"]["downtime_s"]
    wait_for_unit_end(vm, UNIT, timeout=3600, every=1)
    assert not reencryption_underway(vm, LV)
    seconds = unit_seconds(vm, UNIT)
    dd_rates = [LV_MIB / s for s in baseline]
    rate = LV_MIB / seconds
    bench.record("in place: dd of the LV onto itself", "MiB/s", dd_rates)
    bench.record("in place: AES-XTS 512b encryption (cryptsetup benchmark)", "MiB/s", ciphers)
    bench.record("in place: encryption", "MiB/s", [rate], note=f"{LV_MIB} MiB in {seconds:.0f} s")
    bench.record(
        "in place: encryption / dd",
        "ratio",
        [rate / r for r in dd_rates],
        note="the disks are the host's page cache: no bound under emulation",
    )
    bound = [rate / min(c, d) for c, d in zip(ciphers, dd_rates, strict=True)]
    bench.record(
        "in place: encryption / the slower of dd and the cipher",
        "ratio",
        bound,
        target=Target(">=", 0.25),
        note="what the re-encryption's data shift and metadata keep of the bound",
    )
    bench.record(
        "in place: downtime (unmount to mount)",
        "s",
        [downtime],
        target=Target("<", 60),
        note="software emulation; the init writes a 32 MiB header area",
    )
