"""What encrypting a volume in place below LVM costs, in one boot of the lab (software emulation).

The volume of tests/vm/test_moves.py: a striped LV (3 x 64 KiB, 56 extents of 4 MiB on each of
three PVs) with an XFS and 64 MiB of data, encrypted by moves through a spare LUN
(tests/vm/test_moves.py and README, "Below LVM") by `state.apply hana.storage`, nothing
throttled.

1. Rate: the extents the four pvmoves carry (each PV's 56, once each: 896 MiB) over the time
   the unit ran, every step included (four luksFormats, the fills of the new PVs' free extents,
   the spare's erase), and over the time of its pvmoves alone (their steps in the unit's
   journal), against two baselines of the same run: `dd` of as many bytes of the spare onto
   itself (each byte read once and written once, as a pvmove does between two devices), and
   the cipher alone (`cryptsetup benchmark`, AES-XTS with a 512-bit key). The ratio against the
   slower of the two is what the moves keep of the bound. The steps around the pvmoves cost
   about as much whatever the volume's size: on a volume of terabytes the pvmoves' ratio is
   the one that counts.
2. Downtime: none by design; the XFS is checked to be the same mount before and after (its
   mount ID in /proc/self/mountinfo), so the volume was never unmounted.
"""

import pytest

from bench.conftest import Target
from bench.lab_rates import DD_RUNS, cipher_rates, dd_in_place_seconds, step_seconds, unit_seconds
from tests.vm.conftest import failures, wait_for_unit_end
from tests.vm.test_moves import DISKS, MOUNT, SPARE, UNIT, ledger, pillar, plain_lab, pv_table

pytestmark = pytest.mark.vm

EXTENT_MIB = 4


@pytest.fixture(scope="module")
def vm(request):
    vm = plain_lab(request)
    vm.setup_salt(pillar(vm))
    return vm


def mount_id(vm):
    """The mount ID of the XFS at MOUNT (mountinfo's first field): a new one after any remount."""
    return vm.run(f"findmnt -n -o ID {MOUNT}", check=True, echo=False).output.split()[-1]


def test_moves_rate_against_dd_and_no_downtime(vm, bench):
    extents = [alloc for _, alloc in pv_table(vm).values()]
    moved_mib = (sum(extents) + max(extents)) * EXTENT_MIB  # every PV once, and the spare's once more
    baseline = [dd_in_place_seconds(vm, SPARE, moved_mib // 4) * 4 for _ in range(DD_RUNS)]
    ciphers = [cipher_rates(vm)[0] for _ in range(DD_RUNS)]  # encryption
    mounted = mount_id(vm)
    applied = vm.salt(
        "state.apply hana.storage", title="state.apply: encrypt /hana/data by moves, unthrottled"
    )
    assert applied.retcode == 0, failures(applied)
    wait_for_unit_end(vm, UNIT, timeout=3600, every=2)
    assert ledger(vm)["done"], ledger(vm)
    assert mount_id(vm) == mounted, "the XFS was unmounted"
    assert sorted(pv_table(vm)) == sorted(f"/dev/mapper/hana_data_{n}" for n in range(len(DISKS)))
    seconds, steps = unit_seconds(vm, UNIT), step_seconds(vm, UNIT)
    moving = steps.get("move", 0.0) + steps.get("resume", 0.0)
    dd_rates = [moved_mib / s for s in baseline]
    bounds = [min(c, d) for c, d in zip(ciphers, dd_rates, strict=True)]
    rate, pvmove_rate = moved_mib / seconds, moved_mib / moving
    bench.record("moves: dd of the spare onto itself", "MiB/s", dd_rates)
    bench.record("moves: AES-XTS 512b encryption (cryptsetup benchmark)", "MiB/s", ciphers)
    longest = ", ".join(f"{k} {v:.0f} s" for k, v in sorted(steps.items(), key=lambda kv: -kv[1])[:4])
    bench.record(
        "moves: the whole unit",
        "MiB/s",
        [rate],
        note=f"{moved_mib} MiB moved in {seconds:.0f} s; the longest steps: {longest}",
    )
    bench.record("moves: the pvmoves alone", "MiB/s", [pvmove_rate], note=f"{moving:.0f} s")
    bench.record(
        "moves: the whole unit / the slower of dd and the cipher",
        "ratio",
        [rate / b for b in bounds],
        target=Target(">=", 0.05),
        note="formats, fills and the spare's erase counted: under emulation they weigh",
    )
    bench.record(
        "moves: the pvmoves / the slower of dd and the cipher",
        "ratio",
        [pvmove_rate / b for b in bounds],
        note="what pvmove through dm-crypt keeps of the bound",
    )
    bench.record("moves: downtime", "s", [0.0], note="the XFS stayed mounted (the same mount ID)")
