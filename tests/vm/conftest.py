"""The VM tier: a real kernel (QEMU + virtme-ng) with real dm-crypt, LVM and XFS.

Each test module boots one VM for all its tests (software emulation is slow) in its own lab
directory under build/vm-tests/; VMs never run concurrently (the lab holds a machine-wide lock).
"""

import json

import pytest
from hana_lab import Lab

from tests.conftest import REPO

pytestmark = pytest.mark.vm


def boot(request, disks=8, disk_size="2G", fresh=True, **options):
    name = request.module.__name__.rsplit(".", 1)[-1]
    vm = Lab(
        disks=disks,
        disk_size=disk_size,
        workdir=REPO / "build" / "vm-tests" / name,
        fresh=fresh,
        verbose=request.config.getoption("verbose") > 0,
        **options,
    )
    request.addfinalizer(vm.stop)  # first: a failed start leaves no VM behind
    vm.start()
    return vm


def beacon_tick(vm):
    """One beacon tick (a full audit) through Salt's loader in the guest: its events, or its crash."""
    out = vm.run(f"python3 {REPO}/lab/guest_beacon.py once", check=True, echo=False, timeout=900).output
    return json.loads(out.strip().splitlines()[-1])
