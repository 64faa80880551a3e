"""Drift latency: `cryptsetup refresh` drops the perf flags -> the violation event on the master.

A real salt-master on the host (no reactor: the benchmark restores the flags itself, so every
repetition starts compliant and no cooldown is in the way) and a real salt-minion daemon in the
lab VM running the beacon as the formula ships it: no beacon settings in the pillar, so the
defaults of parameters/defaults.yaml (a 1 s tick, a full audit every 300 s).

One clock: each sample starts on the host before the command that causes the drift is handed to
the guest, and ends when the host's event listener receives the master's event. So a sample
includes the command's way into the guest (the lab polls for commands every 0.2 s) and
`cryptsetup refresh` itself: it reads high, never low. The resolved event after the flags are
restored is timed the same way.
"""

import statistics
import time

import pytest

from bench.conftest import Target
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
    overrides = lab_master(tmp_path_factory, vm, beacon=None)  # the shipped beacon settings
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


def test_drift_to_violation_latency(vm, event_listener, master, applied, bench):
    wait_for(event_listener, master, [f"{BEACON}/audit"], applied)  # the beacon is running
    to_violation, to_resolved = [], []
    refresh = f"cryptsetup refresh --key-file {KEY} --persistent"
    for rep in range(REPS):
        before = time.time()
        vm.run(f"{refresh} hana_data", check=True, echo=False)
        violation = wait_for(event_listener, master, [f"{BEACON}/violation"], before, timeout=120)
        to_violation.append(violation[f"{BEACON}/violation"].stamp.timestamp() - before)
        before = time.time()
        vm.run(
            f"{refresh} --perf-no_read_workqueue --perf-no_write_workqueue hana_data", check=True, echo=False
        )
        resolved = wait_for(event_listener, master, [f"{BEACON}/resolved"], before, timeout=120)
        to_resolved.append(resolved[f"{BEACON}/resolved"].stamp.timestamp() - before)
        print(f"[bench] drift {rep + 1}/{REPS}: violation {to_violation[-1]:.2f} s", flush=True)
    shipped = "shipped beacon defaults (1 s tick, full audit every 300 s)"
    bench.record(
        "drift -> violation on the master",
        "s",
        to_violation,
        target=TARGET,
        note=f"p95 {statistics.quantiles(to_violation, n=20)[-1]:.2f} s; {shipped}; from before the "
        "command is sent to the guest",
    )
    bench.record(
        "flags restored -> resolved on the master",
        "s",
        to_resolved,
        target=TARGET,
        note=f"p95 {statistics.quantiles(to_resolved, n=20)[-1]:.2f} s; {shipped}",
    )
