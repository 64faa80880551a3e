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

import re

import pytest

from bench.conftest import Target
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

DD_RUNS = 3


@pytest.fixture(scope="module")
def vm(request):
    vm = plain_lab(request)
    vm.setup_salt(pillar(vm, max_mib_s=None))
    return vm


def dd_in_place_seconds(vm):
    """Seconds for dd to copy the whole LV onto itself (direct I/O, 1 MiB blocks), timed in the
    guest."""
    out = vm.run(
        f"sync && xfs_freeze -f {MOUNT} && s=$(date +%s%N) && "
        f"dd if={LV} of={LV} bs=1M count={LV_MIB} iflag=direct oflag=direct conv=notrunc,fsync status=none; "
        f"rc=$?; e=$(date +%s%N); xfs_freeze -u {MOUNT}; [ $rc = 0 ] && echo $(( (e - s) / 1000000 ))",
        check=True,
        title=f"baseline: dd of {LV} onto itself",
    ).output
    return int(out.split()[-1]) / 1000


def cipher_mib_s(vm):
    """AES-XTS (512-bit key) encryption in memory, MiB/s: `cryptsetup benchmark`."""
    out = vm.run(
        "cryptsetup benchmark --cipher aes-xts-plain64 --key-size 512",
        check=True,
        title="baseline: the cipher",
    ).output
    found = re.search(r"aes-xts\s+512b\s+([\d.]+)\s+MiB/s", out)
    assert found, out
    return float(found.group(1))


def unit_seconds(vm):
    """How long the encryption unit ran, from its journal's first and last monotonic stamps."""
    out = vm.run(
        f"journalctl --unit {UNIT} --output short-monotonic --no-pager", check=True, echo=False
    ).output
    stamps = [float(s) for s in re.findall(r"^\[\s*(\d+\.\d+)\]", out, re.MULTILINE)]
    assert len(stamps) >= 2, out
    return stamps[-1] - stamps[0]


def test_in_place_rate_against_dd_and_the_downtime(vm, bench):
    baseline = [dd_in_place_seconds(vm) for _ in range(DD_RUNS)]
    ciphers = [cipher_mib_s(vm) for _ in range(DD_RUNS)]
    applied = vm.salt("state.apply hana.storage", title="state.apply: encrypt /hana/data in place, uncapped")
    assert applied.retcode == 0, failures(applied)
    downtime = in_place_state(applied)["changes"]["downtime_s"]
    vm.run(
        f"for i in $(seq 3600); do case $(systemctl is-active {UNIT}) in inactive|failed) exit 0;; esac; "
        "sleep 1; done; exit 1",
        check=True,
        timeout=3700,
        title="waiting for the encryption to end",
    )
    assert "reencrypt" not in vm.run(f"cryptsetup luksDump {LV}", check=True, echo=False).output
    seconds = unit_seconds(vm)
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
