"""What re-encrypting a LUKS2 volume online costs, in one boot of the lab (software emulation).

The data volume of tests/vm/test_reencrypt.py: a striped LV (2 x 64 KiB) of LV_MIB MiB, LUKS2
with 512-byte sectors and an undated volume key on it, an XFS with 4 KiB sectors inside, mounted,
96 MiB of data. `state.apply hana.storage` (reencrypt_online, no cap) re-encrypts it to 4096-byte
sectors and a new volume key, mounted: the rate is the bytes of its data segment over the time its unit ran
(its journal's monotonic stamps), against two baselines of the same run: `dd` copying the same
LV onto itself in place (the XFS frozen), and the cipher alone (`cryptsetup benchmark`, AES-XTS
with a 512-bit key). Each byte is decrypted with the old key and encrypted with the new one, so
the cipher's bound is the harmonic sum of its two directions. The ratio against the slower
bound is what the re-encryption keeps of it: checksum resilience (each hotzone's checksums
written to the header before the hotzone) and hotzones bounded to reencrypt.HOTZONE_MAX_MIB so
that I/O to the volume is never held long.
"""

import pytest
import yaml

from bench.conftest import Target
from bench.lab_rates import DD_RUNS, cipher_rates, dd_in_place_seconds, unit_seconds
from tests.vm.conftest import boot, reencryption_underway, wait_for_unit_end, write_lab_key
from tests.vm.test_reencrypt import (
    CRYPT,
    DISKS,
    KEY_FILE,
    LV,
    LV_MIB,
    MOUNT,
    UNIT,
    build_old_data_volume,
    header,
    pillar,
    reencrypt_state,
)

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def vm(request):
    vm = boot(request, disks=len(DISKS), disk_size="640M")
    vm.start_service_manager()
    write_lab_key(vm, KEY_FILE)
    build_old_data_volume(vm)
    data_only = yaml.safe_load(pillar(vm, max_mib_s=None))
    del data_only["hana"]["storage"]["volumes"]["log"]
    vm.setup_salt(yaml.safe_dump(data_only))
    return vm


def cipher_both_ways_mib_s(vm):
    """AES-XTS (512-bit key) in memory, decrypting and encrypting each byte once, MiB/s."""
    encryption, decryption = cipher_rates(vm)
    return 1 / (1 / encryption + 1 / decryption)


def test_reencryption_rate_against_dd_and_the_cipher(vm, bench):
    baseline = [dd_in_place_seconds(vm, LV, LV_MIB, MOUNT) for _ in range(DD_RUNS)]
    ciphers = [cipher_both_ways_mib_s(vm) for _ in range(DD_RUNS)]
    # what the unit re-encrypts: the data segment, the LV less its LUKS2 header (16 MiB)
    data_mib = LV_MIB - int(header(vm)["segments"]["0"]["offset"]) / (1 << 20)
    applied = vm.salt("state.apply hana.storage", title="state.apply: re-encrypt /hana/data online, uncapped")
    assert applied.retcode == 0, applied.text()
    assert reencrypt_state(applied)["changes"]["reencrypting"]["sector_size"] == 4096
    wait_for_unit_end(vm, UNIT, timeout=3600, every=1)
    assert not reencryption_underway(vm, LV)
    assert vm.run(f"blockdev --getss {CRYPT}", echo=False).output.strip() == "4096"
    seconds = unit_seconds(vm, UNIT)
    dd_rates = [LV_MIB / s for s in baseline]
    rate = data_mib / seconds
    bench.record("re-encryption: dd of the LV onto itself", "MiB/s", dd_rates)
    bench.record("re-encryption: AES-XTS 512b decryption + encryption", "MiB/s", ciphers)
    bench.record(
        "re-encryption online: 512 -> 4096-byte sectors, new key",
        "MiB/s",
        [rate],
        note=f"{data_mib:.0f} MiB in {seconds:.0f} s, mounted",
    )
    bench.record(
        "re-encryption: rate / dd",
        "ratio",
        [rate / r for r in dd_rates],
        note="the disks are the host's page cache: no bound under emulation",
    )
    bench.record(
        "re-encryption: rate / the slower of dd and the cipher",
        "ratio",
        [rate / min(c, d) for c, d in zip(ciphers, dd_rates, strict=True)],
        target=Target(">=", 0.10),
        note="what checksum resilience and bounded hotzones keep of the bound",
    )
