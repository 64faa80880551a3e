"""Drift latency: `cryptsetup refresh` drops the perf flags -> the violation event on the master.

A real salt-master on the host (no reactor: the benchmark restores the flags itself, so every
repetition starts compliant and no cooldown is in the way) and a real salt-minion daemon in the
lab VM running the beacon as the formula ships it: no beacon settings in the pillar, so the
defaults of parameters/defaults.yaml (a 1 s tick, a full audit every 300 s).

Each sample is timed on the host's clock:
- from the change: the kernel's uevent for the crypt device (``udevadm monitor --kernel`` in the
  guest, stamped on the guest's monotonic clock when the table was resumed), turned into host
  time with the guest-host clock offset, to the host's event listener receiving the master's
  event. The offset comes from UDP exchanges with a clock server on the host (lab/guest_clock.py),
  at the start and the end of the run, interpolated between them; its error bound (half the
  shortest round trip, about a millisecond) is in the note. This is what the beacon and Salt add,
  and what the target applies to. The note splits it at the beacon event's own ``ts``: the guest
  (the tick's wait and the audit) and Salt (minion -> master -> listener).
- from before the cause: the host's time before the command is handed to the guest. It includes
  the command's way into the guest (the lab polls for commands every 0.2 s) and `cryptsetup
  refresh` itself, key derivation included, which under software emulation takes most of a
  second: informational.
"""

import re
import statistics
import time

import pytest

from bench.conftest import Target, p95
from tests.support.lab_master import BEACON, KEY, MINION, connect_minion, lab_master, wait_for
from tests.vm.conftest import boot

pytestmark = pytest.mark.vm

REPS = 20
TARGET = Target("<", 2, "p95")


@pytest.fixture(scope="module")
def vm(request):
    return boot(request, disks=3, disk_size="1G", network=True)


@pytest.fixture(scope="module")
def master(salt_factories, tmp_path_factory, vm):
    # the shipped beacon settings; no reactor: a remediation would restore the flags before the
    # benchmark does, and load the guest while the next sample is taken
    overrides = lab_master(tmp_path_factory, vm, beacon=None, reactor=False)
    factory = salt_factories.salt_master_daemon("hana-drift-master", overrides=overrides)
    with factory.started(start_timeout=120):
        yield factory


@pytest.fixture(scope="module")
def applied(vm, master):
    cli = connect_minion(vm, master)
    started = time.time()
    states = cli.run("state.apply", "hana.storage", minion_tgt=MINION, _timeout=1200).data
    assert isinstance(states, dict) and all(s["result"] for s in states.values()), states
    return started


UEVENTS = "/run/drift-uevents.log"
UEVENT = re.compile(r"^KERNEL\[(\d+\.\d+)\]\s+change\s+\S+/(\S+)\s+\(block\)$")


def watch_uevents(vm):
    """udevadm monitor in the guest, printing every block uevent with its monotonic stamp."""
    vm.run(
        f"setsid -f udevadm monitor --kernel --subsystem-match=block >{UEVENTS} 2>&1 </dev/null; "
        f"for _ in $(seq 100); do grep -q KERNEL {UEVENTS} && exit 0; sleep 0.1; done; exit 1",
        check=True,
        echo=False,
    )


def uevent_stamps(vm, device, realtime_minus_monotonic):
    """Guest wall-clock times of every `change` uevent of ``device`` (a kernel name, dm-N)."""
    log = vm.run(f"cat {UEVENTS}", check=True, echo=False).output
    return sorted(
        float(m[1]) + realtime_minus_monotonic
        for m in map(UEVENT.match, log.splitlines())
        if m and m[2] == device
    )


def cause(vm, command):
    """Run ``command`` in the guest: (host time before it was sent, guest times it started and
    returned)."""
    before = time.time()
    out = vm.run(f"date +%s.%N && {command} && date +%s.%N", check=True, echo=False).output.split()
    return before, float(out[0]), float(out[-1])


def test_drift_to_violation_latency(vm, event_listener, master, applied, bench):
    wait_for(event_listener, master, [f"{BEACON}/audit"], applied)  # the beacon is running
    device = vm.run("basename $(readlink -f /dev/mapper/hana_data)", check=True, echo=False).output.split()[
        -1
    ]
    watch_uevents(vm)
    first, first_host = vm.clock(), time.time()
    samples = {"violation": [], "resolved": []}  # (before, guest start, guest end, received, beacon ts)
    refresh = f"cryptsetup refresh --key-file {KEY} --persistent"
    drop, restore = (
        f"{refresh} hana_data",
        f"{refresh} --perf-no_read_workqueue --perf-no_write_workqueue hana_data",
    )
    for rep in range(REPS):
        for event, command in (("violation", drop), ("resolved", restore)):
            before, started, returned = cause(vm, command)
            seen = wait_for(event_listener, master, [f"{BEACON}/{event}"], before, timeout=120)[
                f"{BEACON}/{event}"
            ]
            samples[event].append((before, started, returned, seen.stamp.timestamp(), seen.data["ts"]))
        print(f"[bench] drift {rep + 1}/{REPS}", flush=True)
    last, last_host = vm.clock(), time.time()
    changes = uevent_stamps(vm, device, first["realtime_minus_monotonic"])

    def host_time(guest):  # the offset moves a little under emulation: interpolated over the run
        share = min(max((guest - first["offset"] - first_host) / (last_host - first_host), 0), 1)
        return guest - (first["offset"] + share * (last["offset"] - first["offset"]))

    shipped = "shipped beacon defaults (1 s tick, full audit every 300 s)"
    clock = (
        f"guest clock offset {first['offset']:+.4f} s +- {first['error'] * 1000:.1f} ms at the start, "
        f"{last['offset']:+.4f} s +- {last['error'] * 1000:.1f} ms at the end"
    )
    for event, name in (("violation", "drift -> violation"), ("resolved", "flags restored -> resolved")):
        from_change, from_cause, in_guest, in_salt = [], [], [], []
        for before, started, returned, received, ts in samples[event]:
            change = next((c for c in changes if started <= c <= returned), None)
            assert change is not None, f"no uevent of {device} while `cryptsetup refresh` ran ({event})"
            from_change.append(received - host_time(change))
            from_cause.append(received - before)
            in_guest.append(ts - change)
            in_salt.append(received - host_time(ts))
        bench.record(
            f"{name} on the master, from the change",
            "s",
            from_change,
            target=TARGET,
            note=f"p95 {p95(from_change):.2f} s; of that, median in the guest (the tick's wait, the "
            f"audit) {statistics.median(in_guest):.2f} s (p95 {p95(in_guest):.2f}), in Salt (minion -> "
            f"master -> listener) {statistics.median(in_salt):.2f} s (p95 {p95(in_salt):.2f}); {shipped}; {clock}",
        )
        bench.record(
            f"{name} on the master, from before the cause",
            "s",
            from_cause,
            note=f"p95 {p95(from_cause):.2f} s; includes the command's way into the guest and cryptsetup "
            "refresh (key derivation under emulation)",
        )
